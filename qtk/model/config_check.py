"""Sanity of a config.json's sizes, on the plain dict, before anything is built from them.

A hostile or corrupt config (num_hidden_layers 10000000, hidden_size -128 or 1e9) would otherwise make
transformers build, and qtk allocate, whatever it claims. Everything here is arithmetic on the dict: no
transformers, no tensors. `check_sizes` needs the config alone (what `qtk plan` has); `check_against_weights`
also bounds it by the bytes of weights on disk (what `qtk convert` has).
"""

from __future__ import annotations

from typing import Mapping

from qtk.errors import UsageError

# sizes every supported architecture has; each must be a positive integer
REQUIRED = ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size")
# sizes some architectures have; null means "the default" and is left to transformers
OPTIONAL = ("num_key_value_heads", "head_dim", "intermediate_size", "max_position_embeddings", "moe_intermediate_size")
# counts that are 0 in dense variants of a family
COUNTS = ("num_local_experts", "num_experts", "num_experts_per_tok")
# no real model comes near: a bound that keeps the arithmetic below (and transformers' allocations) finite
LIMIT = 2**31 - 1
FIX = "restore the model's original config.json"


def _size(cfg: Mapping, key: str, where: str, least: int = 1) -> int | None:
    v = cfg.get(key)
    if v is None:
        return None
    kind = "a positive" if least else "a non-negative"
    if isinstance(v, bool) or not isinstance(v, int) or v < least:
        raise UsageError(f"{where}: {key} must be {kind} integer (got {_short(v)})", FIX)
    if v > LIMIT:
        raise UsageError(f"{where}: {key} {_short(v)} is not a plausible size (at most 2^31 - 1)", FIX)
    return v


def _short(v) -> str:
    text = repr(v)
    return text if len(text) <= 40 else f"{text[:20]}...({len(text)} characters)"


def check_sizes(cfg: Mapping, where: str = "config.json") -> dict[str, int]:
    """The sizes of `cfg` that are set, each a positive integer (expert counts: non-negative), and mutually
    consistent; raises UsageError naming the key otherwise."""
    sizes = {k: v for k in (*REQUIRED, *OPTIONAL) if (v := _size(cfg, k, where)) is not None}
    sizes.update({k: v for k in COUNTS if (v := _size(cfg, k, where, least=0)) is not None})
    heads, kv = sizes.get("num_attention_heads"), sizes.get("num_key_value_heads")
    hidden = sizes.get("hidden_size")
    if heads and kv and (kv > heads or heads % kv):
        raise UsageError(f"{where}: num_key_value_heads {kv} does not divide num_attention_heads {heads}", FIX)
    if heads and hidden and "head_dim" not in sizes and hidden % heads:
        raise UsageError(f"{where}: hidden_size {hidden} is not a multiple of num_attention_heads {heads} "
                         "(and there is no head_dim)", FIX)
    experts = sizes.get("num_local_experts") or sizes.get("num_experts")
    if experts and sizes.get("num_experts_per_tok", 0) > experts:
        raise UsageError(f"{where}: num_experts_per_tok {sizes['num_experts_per_tok']} exceeds the {experts} experts", FIX)
    return sizes


def min_parameters(sizes: Mapping[str, int]) -> int:
    """A lower bound on the parameters a config describes: the embedding and every layer's attention
    projections (q, k, v, o). MLPs and experts are left out, so no architecture can hold fewer."""
    hidden, layers = sizes.get("hidden_size", 1), sizes.get("num_hidden_layers", 1)
    heads = sizes.get("num_attention_heads", 1)
    kv = sizes.get("num_key_value_heads", heads)
    head_dim = sizes.get("head_dim", hidden // heads or 1)
    attention = hidden * head_dim * (2 * heads + 2 * kv)
    return sizes.get("vocab_size", 1) * hidden + layers * attention


def check_against_weights(cfg: Mapping, weight_bytes: int, tensor_count: int, where: str = "config.json") -> None:
    """Refuse a config that describes more than the weight files can hold: more parameters than
    `weight_bytes` (one byte each, at the least), or more layers or experts than there are tensors
    (a layer holds at least one tensor, an MoE layer three per expert). Nothing is built before this."""
    sizes = check_sizes(cfg, where)
    layers = sizes.get("num_hidden_layers", 1)
    experts = sizes.get("num_local_experts") or sizes.get("num_experts") or 0
    for what, n, least in (("num_hidden_layers", layers, layers), ("experts per layer", experts, 3 * experts)):
        if least > tensor_count:
            raise UsageError(f"{where}: {what} {n} needs at least {least} tensors but the weight files hold {tensor_count}",
                             "the config does not belong to these weights: " + FIX)
    need = min_parameters(sizes)
    if need > weight_bytes:
        raise UsageError(f"{where} describes at least {_count(need)} parameters ({sizes.get('num_hidden_layers', '?')} "
                         f"layers, hidden_size {sizes.get('hidden_size', '?')}, vocab_size {sizes.get('vocab_size', '?')}) "
                         f"but the weight files hold {weight_bytes / 1e6:.1f} MB",
                         "the config does not belong to these weights: " + FIX)


def _count(n: int) -> str:
    for unit, div in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= div:
            return f"{n / div:.3g}{unit}"
    return str(n)
