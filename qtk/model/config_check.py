"""Sanity checks on a config.json dict before anything is built from it: sizes that are positive integers
within what any real model uses, and mutually consistent; within what the weight files on disk can hold (convert);
and the tensor-parallel sizes a model's heads allow.

Plain dict code (no transformers, no torch), so `qtk plan` and `qtk convert` refuse a hostile or broken config
in microseconds instead of building millions of layers from it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Mapping

from qtk.errors import UsageError

# Ceilings far above every published model (the largest use ~130 layers, hidden 25k, 262k-token vocabularies,
# 384 experts), low enough that nothing sized by them can exhaust a machine's memory or time.
MAX_LAYERS = 4096
MAX_HIDDEN = 1 << 17
MAX_HEADS = 1 << 14
MAX_HEAD_DIM = 1 << 12
MAX_VOCAB = 1 << 22
MAX_INTERMEDIATE = 1 << 20
MAX_EXPERTS = 1 << 14
MAX_POSITIONS = 1 << 30
MAX_PARAMS = 10**14  # ~50x the largest published model
MAX_CONFIG_BYTES = 16 * 2**20  # real config.json files are a few KB; a multimodal one with a vocabulary map < 1 MB
MAX_CONFIG_LIST = 1 << 17  # entries of any list in a config (rope factors, token ids, image grids are far fewer)

# key -> (ceiling, smallest allowed value): 1 for sizes every model has, 0 for counts that may be absent (0 = none)
TEXT_SIZES: dict[str, tuple[int, int]] = {
    "num_hidden_layers": (MAX_LAYERS, 1), "n_layer": (MAX_LAYERS, 1), "num_layers": (MAX_LAYERS, 1),
    "hidden_size": (MAX_HIDDEN, 1), "n_embd": (MAX_HIDDEN, 1), "d_model": (MAX_HIDDEN, 1),
    "num_attention_heads": (MAX_HEADS, 1), "n_head": (MAX_HEADS, 1), "num_key_value_heads": (MAX_HEADS, 1),
    "head_dim": (MAX_HEAD_DIM, 1),
    "vocab_size": (MAX_VOCAB, 1),
    "intermediate_size": (MAX_INTERMEDIATE, 1), "moe_intermediate_size": (MAX_INTERMEDIATE, 1),
    "shared_expert_intermediate_size": (MAX_INTERMEDIATE, 0),
    "num_local_experts": (MAX_EXPERTS, 0), "num_experts": (MAX_EXPERTS, 0), "n_routed_experts": (MAX_EXPERTS, 0),
    "num_experts_per_tok": (MAX_EXPERTS, 0), "n_shared_experts": (MAX_EXPERTS, 0),
    "max_position_embeddings": (MAX_POSITIONS, 1), "sliding_window": (MAX_POSITIONS, 0),
    "kv_lora_rank": (MAX_HIDDEN, 0), "q_lora_rank": (MAX_HIDDEN, 0),
    "qk_rope_head_dim": (MAX_HEAD_DIM, 0), "qk_nope_head_dim": (MAX_HEAD_DIM, 0), "v_head_dim": (MAX_HEAD_DIM, 0),
    # which layers are dense / sparse / sliding: indices and strides, never more than the layer count
    "first_k_dense_replace": (MAX_LAYERS, 0), "moe_layer_freq": (MAX_LAYERS, 0), "decoder_sparse_step": (MAX_LAYERS, 0),
    "sliding_window_pattern": (MAX_LAYERS, 0), "max_window_layers": (MAX_LAYERS, 0),
}
VISION_SIZES: dict[str, tuple[int, int]] = {
    "hidden_size": (MAX_HIDDEN, 1), "embed_dim": (MAX_HIDDEN, 1), "depth": (MAX_LAYERS, 1),
    "num_hidden_layers": (MAX_LAYERS, 1), "intermediate_size": (MAX_INTERMEDIATE, 1),
    "patch_size": (MAX_HEAD_DIM, 1), "temporal_patch_size": (MAX_HEAD_DIM, 1), "spatial_merge_size": (MAX_HEAD_DIM, 1),
    "in_channels": (MAX_HEAD_DIM, 1), "num_channels": (MAX_HEAD_DIM, 1), "out_hidden_size": (MAX_HIDDEN, 1),
}
FIX = "restore the model's original config.json"
DTYPE_NAMES = {"bfloat16", "float16", "float32", "bf16", "fp16", "half", "fp32", "float"}  # as qtk plan reads them

# float settings every model keeps in a narrow range: (lowest, highest, whether the lowest itself is allowed); a value
# outside it (an epsilon of 0 or Infinity, a negative rope base) is no model's and would surface only as NaN after
# the whole conversion
FLOAT_RANGES: dict[str, tuple[float, float, bool]] = {
    "rms_norm_eps": (0.0, 1.0, False), "layer_norm_eps": (0.0, 1.0, False), "layer_norm_epsilon": (0.0, 1.0, False),
    "norm_eps": (0.0, 1.0, False), "norm_epsilon": (0.0, 1.0, False),
    "rope_theta": (0.0, 1e15, False), "partial_rotary_factor": (0.0, 1.0, False),
    "attention_dropout": (0.0, 1.0, True), "hidden_dropout": (0.0, 1.0, True),
    "initializer_range": (0.0, 1e3, True),
    "final_logit_softcapping": (0.0, 1e6, False), "attn_logit_softcapping": (0.0, 1e6, False),
    "query_pre_attn_scalar": (0.0, 1e9, False), "factor": (0.0, 1e6, False),
}


def read_config_json(f: Path) -> dict:
    """A model's config.json as a dict, refused (UsageError, exit 2) when it is larger than MAX_CONFIG_BYTES, not
    UTF-8 JSON (nesting deeper than the parser follows included), or not an object. Shared by qtk convert (through
    ModelSource) and qtk plan."""
    from qtk.bounds import parse_json

    try:
        size = f.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise UsageError(f"{f} is {size:,} bytes, more than the {MAX_CONFIG_BYTES // 2**20} MiB qtk reads for a "
                             "config.json", FIX)
        cfg = parse_json(f.read_bytes()[: MAX_CONFIG_BYTES + 1])
    except json.JSONDecodeError as e:
        raise UsageError(f"{f} is not valid JSON ({e.__class__.__name__}: {e})", FIX) from None
    except UnicodeDecodeError as e:
        raise UsageError(f"{f} is not UTF-8 text (byte {e.start}), so not a config.json", FIX) from None
    except ValueError as e:  # nesting the parser cannot follow, an integer of more than 4300 digits
        raise UsageError(f"{f} cannot be parsed ({' '.join(str(e).split())[:120]})", FIX) from None
    except OSError as e:
        raise UsageError(f"cannot read {f} ({e.strerror or e})", "check the path and its permissions") from None
    if not isinstance(cfg, dict):
        raise UsageError(f"{f} is not a JSON object", FIX)
    return cfg


def _show(v) -> str:
    s = repr(v)
    return s if len(s) <= 24 else (f"a {len(str(abs(v)))}-digit number" if isinstance(v, int) else s[:20] + "…")


def _first(d: Mapping, *keys):
    return next((d[k] for k in keys if d.get(k) is not None), None)


def text_config(cfg: Mapping) -> dict:
    """The language model's keys: a multimodal config's text_config over its top-level keys (as transformers reads them)."""
    if isinstance(cfg.get("text_config"), Mapping):
        return {**{k: v for k, v in cfg.items() if k not in ("text_config", "vision_config")}, **cfg["text_config"]}
    return dict(cfg)


def _check_sizes(d: Mapping, sizes: Mapping[str, tuple[int, int]], where: str) -> None:
    for key, (ceiling, least) in sizes.items():
        v = d.get(key)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int):
            raise UsageError(f"{where}: {key} is {_show(v)}, not a whole number", FIX)
        if v < least:
            raise UsageError(f"{where}: {key} is {v}; it must be {'positive' if least else '>= 0'}", FIX)
        if v > ceiling:
            raise UsageError(f"{where}: {key} is {_show(v)}, far more than any real model (at most {ceiling:,} accepted)", FIX)


def _check_values(cfg: Mapping, layers, where: str) -> None:
    """Every number finite, known float settings in range, every list of a length a model can have: a per-layer list
    (a key naming layers: layer_types, mlp_only_layers, ...) at most one entry per layer, any other at most
    MAX_CONFIG_LIST: a config is read whole, rewritten into every output, and per-layer lists are expanded per layer."""
    most = layers if isinstance(layers, int) and not isinstance(layers, bool) and 0 < layers <= MAX_LAYERS else MAX_LAYERS
    stack: list[tuple[str, object]] = [("", cfg)]
    while stack:
        path, v = stack.pop()
        key = path.rpartition(".")[2]
        if isinstance(v, float) and not math.isfinite(v):
            raise UsageError(f"{where}: {path} is {v}, not a finite number", FIX)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and key in FLOAT_RANGES:
            lo, hi, closed = FLOAT_RANGES[key]
            if not ((lo <= v if closed else lo < v) and v <= hi):
                side = "[" if closed else "("
                raise UsageError(f"{where}: {path} is {_show(v)}, outside {side}{lo:g}, {hi:g}], where every model "
                                 "keeps it", FIX)
        if isinstance(v, list):
            limit = most if "layer" in key else MAX_CONFIG_LIST
            if len(v) > limit:
                what = f"{limit:,} (one per layer)" if "layer" in key else f"{limit:,}"
                raise UsageError(f"{where}: {path} has {len(v):,} entries, more than {what}", FIX)
            stack.extend((f"{path}[{i}]", x) for i, x in enumerate(v) if isinstance(x, (list, dict, float, int)))
        elif isinstance(v, Mapping):
            stack.extend((f"{path}.{k}" if path else str(k), x) for k, x in v.items())


def check_config_sizes(cfg: Mapping, where: str = "config.json") -> None:
    """Refuse (UsageError, exit 2) a config whose sizes are not positive integers, exceed any real model, or
    contradict each other. Only keys that are present are checked; a missing key is the caller's concern."""
    if not isinstance(cfg, Mapping):
        raise UsageError(f"{where} holds a {type(cfg).__name__}, not a JSON object", FIX)
    for sub in ("text_config", "vision_config"):
        if cfg.get(sub) is not None and not isinstance(cfg[sub], Mapping):
            raise UsageError(f"{where}: {sub} is {_show(cfg[sub])}, not an object", FIX)
    t = text_config(cfg)
    _check_sizes(t, TEXT_SIZES, where)
    if isinstance(cfg.get("vision_config"), Mapping):
        _check_sizes(cfg["vision_config"], VISION_SIZES, f"{where}: vision_config")
    _check_values(cfg, _first(t, "num_hidden_layers", "n_layer", "num_layers"), where)
    for key in ("dtype", "torch_dtype"):  # the weights' dtype: named in every output's config and serving flags
        v = t.get(key)
        if v is not None and not (isinstance(v, str) and v.lower().removeprefix("torch.") in DTYPE_NAMES):
            raise UsageError(f"{where}: {key} is {_show(v)}, not a dtype qtk converts from (bfloat16, float16, float32)", FIX)

    hidden = _first(t, "hidden_size", "n_embd", "d_model")
    heads = _first(t, "num_attention_heads", "n_head")
    kv_heads = t.get("num_key_value_heads")
    if hidden and heads and t.get("head_dim") is None and not t.get("kv_lora_rank") and hidden % heads:
        raise UsageError(f"{where}: hidden_size {hidden} is not a multiple of num_attention_heads {heads} (and no head_dim is given)", FIX)
    if heads and kv_heads and (kv_heads > heads or heads % kv_heads):
        raise UsageError(f"{where}: num_key_value_heads {kv_heads} does not divide num_attention_heads {heads}", FIX)
    experts = _first(t, "num_local_experts", "num_experts", "n_routed_experts") or 0
    top_k = t.get("num_experts_per_tok") or 0
    if top_k > experts > 0:
        raise UsageError(f"{where}: num_experts_per_tok {top_k} exceeds the {experts} experts", FIX)
    layers = _first(t, "num_hidden_layers", "n_layer", "num_layers")
    if layers and hidden:
        inter = max(t.get("intermediate_size") or 4 * hidden, (t.get("moe_intermediate_size") or 0) * experts)
        params = layers * hidden * (4 * hidden + 3 * inter) + 2 * (t.get("vocab_size") or 0) * hidden
        if params > MAX_PARAMS:
            raise UsageError(f"{where}: {layers} layers of hidden size {hidden} (intermediate {inter}) make about "
                             f"{params / 1e12:,.0f}T parameters, far more than any real model", FIX)


def tp_divisors(n: int, candidates=(1, 2, 4, 8)) -> list[int]:
    return [d for d in candidates if n % d == 0]


def check_tensor_parallel(tp: int, heads: int, kv_heads: int, intermediate: int | None = None) -> None:
    """Refuse a tensor-parallel size the engines cannot split the model over (vLLM and TensorRT-LLM alike): every
    rank gets a whole number of attention heads, the KV heads are split evenly or each copied to tp/kv ranks,
    and the MLP width splits evenly."""
    def refuse(what: str, n: int):
        raise UsageError(f"--tp {tp} does not divide {what} ({n})", f"use --tp {' or '.join(map(str, tp_divisors(n)))}")

    if heads % tp:
        refuse("the attention heads", heads)
    if kv_heads % tp if kv_heads >= tp else tp % kv_heads:
        raise UsageError(f"--tp {tp} cannot share the {kv_heads} KV heads evenly (split them, or copy each to tp/kv ranks)",
                         f"use a --tp that divides {kv_heads} or is a multiple of it")
    if intermediate is not None and intermediate % tp:
        refuse("intermediate_size", intermediate)


def min_parameters(cfg: Mapping) -> int:
    """A lower bound on the parameters a (size-checked) config describes: the embedding and every layer's attention
    projections (q, k, v, o). MLPs and experts are left out, so no architecture can hold fewer."""
    t = text_config(cfg)
    hidden = _first(t, "hidden_size", "n_embd", "d_model") or 1
    layers = _first(t, "num_hidden_layers", "n_layer", "num_layers") or 1
    heads = _first(t, "num_attention_heads", "n_head") or 1
    kv = t.get("num_key_value_heads") or heads
    head_dim = t.get("head_dim") or (hidden // heads or 1)
    return (t.get("vocab_size") or 1) * hidden + layers * hidden * head_dim * (2 * heads + 2 * kv)


def check_against_weights(cfg: Mapping, weight_bytes: int, tensor_count: int, where: str = "config.json") -> None:
    """`check_config_sizes`, then refuse a config that describes more than the weight files can hold: more
    parameters than `weight_bytes` (one byte each, at the least), or more layers or experts than there are tensors
    (a layer holds at least one tensor, an MoE layer three per expert). Nothing is built before this."""
    check_config_sizes(cfg, where)
    t = text_config(cfg)
    layers = _first(t, "num_hidden_layers", "n_layer", "num_layers") or 1
    experts = _first(t, "num_local_experts", "num_experts", "n_routed_experts") or 0
    for what, n, least in (("num_hidden_layers", layers, layers), ("experts per layer", experts, 3 * experts)):
        if least > tensor_count:
            raise UsageError(f"{where}: {what} {n} needs at least {least} tensors but the weight files hold {tensor_count}",
                             "the config does not belong to these weights: " + FIX)
    need = min_parameters(cfg)
    if need > weight_bytes:
        raise UsageError(f"{where} describes at least {_count(need)} parameters ({layers} layers, hidden_size "
                         f"{_first(t, 'hidden_size', 'n_embd', 'd_model')}, vocab_size {t.get('vocab_size')}) "
                         f"but the weight files hold {weight_bytes / 1e6:.1f} MB",
                         "the config does not belong to these weights: " + FIX)


def _count(n: int) -> str:
    for unit, div in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= div:
            return f"{n / div:.3g}{unit}"
    return str(n)



def fp8_block_misfit(parts: list[int], in_features: int, block: tuple[int, int], tp: int = 1, *,
                     split: str = "column", shard_parts: list[int] | None = None) -> tuple[int, str] | None:
    """Why vLLM cannot run FP8 blocks on one GEMM: (the index of the part at fault, the rule it breaks), or None.

    parts: the output sizes of the Linears vLLM runs as that GEMM, in its order (q, k, v; gate, up; one entry for an
    unmerged Linear); shard_parts: their sizes on one tp rank where that is not part // tp (K/V heads replicated when
    tp exceeds them); split: how tensor parallelism cuts the GEMM ("column": its outputs, "row": its inputs, "none":
    replicated, "experts": a fused-MoE expert); block = (rows, columns) = vLLM's (block_n, block_k).

    The output rule is vLLM's validate_fp8_block_shape: a GEMM whose outputs are split over tp ranks needs every part's
    shard to be a multiple of block_n; a merged GEMM that is not split needs every part but the last to be one (the
    last part may end in a partial block row: scale grid ceil(out/block_n)); an unmerged Linear may have any output
    size. The input size (per shard) must be a multiple of block_k at every tp: validate_fp8_block_shape lets a ragged
    input through at tp 1, but the activations cannot then be quantized per token per group of block_k: vLLM's CUDA
    quantizer (fp8_utils.per_token_group_quant_fp8, used whenever the quant_fp8 custom op is on, e.g. with
    --enforce-eager) asserts in % group_size == 0, and compressed-tensors' group fake-quant raises (its own note: vLLM
    needs the columns divisible). Fused-MoE experts are held to whole blocks both ways (per shard of the intermediate),
    as vLLM's fused-MoE FP8 block methods check."""
    bn, bk = block
    split_out = tp > 1 and split in ("column", "experts")
    shards = list(shard_parts) if shard_parts is not None else [p // tp if split_out else p for p in parts]
    if split == "row" and tp > 1:
        if in_features % tp or (in_features // tp) % bk:
            return 0, f"its input size {in_features} split over tp {tp} is not a multiple of block_k {bk} per shard"
    elif in_features % bk:
        return 0, (f"its input size {in_features} is not a multiple of block_k {bk} (the activations are quantized "
                   f"per token in whole groups of {bk})")
    if split == "experts" or split_out:
        for k, (p, s) in enumerate(zip(parts, shards)):
            if (split_out and s * tp != p and shard_parts is None) or s % bn:
                where = f" split over tp {tp}" if split_out else ""
                return k, f"its {p} outputs{where} are not a multiple of block_n {bn}" + (" per shard" if split_out else "")
        return None
    for k, p in enumerate(parts[:-1]):
        if p % bn:
            return k, (f"it is merged into one GEMM with the Linears after it and its {p} outputs are not a multiple of "
                       f"block_n {bn} (only the last member of a merged GEMM may end in a partial block)")
    return None
