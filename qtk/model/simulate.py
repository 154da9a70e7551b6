"""Simulation of what the engines run: Linears with dequantized weights and fake-quantized inputs,
and an attention function that observes or quantizes K (after RoPE) and V per layer.

The same modules propagate activations during conversion and run the candidate in `qtk eval`, so the
model qtk calibrates against is the model it validates.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from qtk.quant.qparams import FP8_DTYPE, fake_quant_activation
from qtk.quant.scheme import FP8_MAX, QuantScheme

ATTN_IMPL = "qtk"
_registered = False


class QLinear(torch.nn.Module):
    """y = Q(x) @ dequant(W)^T + b, activations quantized as the engine does (per-token dynamic or static).

    input_rotation: an online transform the engine applies to the input before the quantized GEMM (an object with
    apply(x), e.g. qtk.quant.hadamard.RepeatedRotation, or DenseRotation from a checkpoint's stored matrix), then
    y = Q(x R) @ dequant(W)^T + b; its result is rounded to the input's dtype, as the engine's GEMM returns it."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, act: QuantScheme | None = None,
                 input_scale: torch.Tensor | None = None, input_rotation=None):
        super().__init__()
        self.input_rotation = input_rotation
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)
        self.act = act
        self.register_buffer("input_scale", input_scale, persistent=False)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self._fused: tuple[FusedGEMM, int] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._fused is not None:
            return self._fused[0](x, self._fused[1])
        if self.input_rotation is not None:
            x = self.input_rotation.apply(x).to(x.dtype)
        if self.act is not None:
            x = fake_quant_activation(x, self.act, self.input_scale)
        return F.linear(x, self.weight, self.bias)


class FusedGEMM:
    """The engines run Linears that read one input (q/k/v, gate/up) as one GEMM on one quantized input. The
    first member called computes every member's output; its siblings, called next with the same tensor, take
    theirs. Members' weights become row slices of the fused weight (no second copy). Per-output-element
    results equal separate Linears (each is the same dot product over the input; checked in the tests)."""

    def __init__(self, members: list[QLinear]):
        self.act, self.scale = members[0].act, members[0].input_scale
        self.sizes = [m.out_features for m in members]
        self.weight = torch.cat([m.weight.detach() for m in members])
        biases = [m.bias for m in members]
        self.bias = None if all(b is None for b in biases) else torch.cat(
            [b.detach() if b is not None else torch.zeros(m.out_features, dtype=self.weight.dtype)
             for b, m in zip(biases, members)])
        r = 0
        for i, m in enumerate(members):
            m.weight = torch.nn.Parameter(self.weight[r: r + m.out_features], requires_grad=False)
            if m.bias is not None:
                m.bias = torch.nn.Parameter(self.bias[r: r + m.out_features], requires_grad=False)
            r += m.out_features
            m._fused = (self, i)
        self.key, self.parts = None, None

    @staticmethod
    def can_fuse(members: list[QLinear]) -> bool:
        """One input quantization serves all: same scheme and the same static scale (or none)."""
        m0 = members[0]
        return len(members) > 1 and all(
            m.input_rotation is None and m.act == m0.act and m.in_features == m0.in_features and m.weight.dtype == m0.weight.dtype
            and ((m.input_scale is None and m0.input_scale is None)
                 or (m.input_scale is not None and m0.input_scale is not None and torch.equal(m.input_scale, m0.input_scale)))
            for m in members)

    def __call__(self, x: torch.Tensor, i: int) -> torch.Tensor:
        # inference-mode tensors keep no version counter; model code does not modify a Linear's input in place
        version = -1 if x.is_inference() else x._version
        if self.key is None or self.key[0] is not x or self.key[1] != version:
            xq = fake_quant_activation(x, self.act, self.scale) if self.act is not None else x
            y = F.linear(xq, self.weight, self.bias)
            self.parts = [p.contiguous() for p in y.split(self.sizes, dim=-1)]
            self.key = (x, version)
        out = self.parts[i]
        if i == len(self.sizes) - 1:  # the last member was served: let go of the input and the outputs
            self.key, self.parts = None, None
        return out


def fuse_groups(model: torch.nn.Module, modules: list[str], groups) -> int:
    """Fuse the QLinears of each fusion group (arch suffixes, e.g. self_attn.q_proj/k_proj/v_proj) of every layer.
    Returns the number of groups fused."""
    n = 0
    for members in fusion_members(modules, groups):
        mods = [model.get_submodule(x) for x in members]
        if all(isinstance(x, QLinear) for x in mods) and FusedGEMM.can_fuse(mods):
            FusedGEMM(mods)
            n += 1
    return n


def engine_weight(qt) -> torch.Tensor:
    """The dequantized weight, computed in the dtype the format's spec says the engines form it in: the model dtype
    for int formats, NVFP4, MX and FP8 blocks (as compressed-tensors and the dequantizing kernels do), float32 for
    per-tensor / per-channel fp8. float32 out."""
    w = qt.dequantize()
    return w.to(qt.dtype).float() if qt.format.decodes_in_model_dtype(qt.scheme) else w


def fusion_members(modules: list[str], groups) -> list[list[str]]:
    """The members of each fusion group (arch suffixes, e.g. self_attn.q_proj/k_proj/v_proj) present in modules."""
    names, out = set(modules), []
    for m in modules:
        for g in groups:
            if m.endswith("." + g[0]):
                members = [m[: -len(g[0])] + x for x in g]
                if all(x in names for x in members):
                    out.append(members)
    return out


def max_scale_weights(qts: list) -> list[torch.Tensor] | None:
    """float32 weights of fused members as the engines run them in one GEMM (their format's fused_weights: vLLM
    requantizes per-tensor FP8 members to the largest scale), or None when each runs as its own decode."""
    fmt = qts[0].format
    if any(qt.format is not fmt for qt in qts):
        return None
    return fmt.fused_weights(qts)


def _qtk_attention(module, query, key, value, attention_mask, **kwargs):
    hook = getattr(module, "_qtk_kv_hook", None)
    if hook is not None:
        key, value = hook(key, value)
    # logit soft-capping (Gemma 2) and attention sinks (gpt-oss's s_aux, a learned logit per head in the softmax's
    # denominator): only the model's eager code has them (transformers' sdpa drops s_aux)
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        import sys

        eager = sys.modules[type(module).__module__].eager_attention_forward
        return eager(module, query, key, value, attention_mask, **kwargs)
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


ATTN_IMPL_EAGER = "qtk_eager"


def use_qtk_attention(model_or_config) -> None:
    """Route attention through qtk's function so K/V hooks can run: sdpa underneath with sdpa masks, or,
    for models with attention soft-capping or sinks, the model's eager attention with eager (materialised) masks."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

        AttentionInterface.register(ATTN_IMPL, _qtk_attention)
        AttentionMaskInterface.register(ATTN_IMPL, sdpa_mask)
        AttentionInterface.register(ATTN_IMPL_EAGER, _qtk_attention)
        AttentionMaskInterface.register(ATTN_IMPL_EAGER, eager_mask)
        _registered = True
    config = getattr(model_or_config, "config", model_or_config)
    from qtk.model.arch import ARCHS

    softcap = getattr(config, "attn_logit_softcapping", None)
    arch = ARCHS.get(getattr(config, "model_type", None))
    eager = softcap is not None or (arch is not None and arch.attn_sinks)
    config._attn_implementation = ATTN_IMPL_EAGER if eager else ATTN_IMPL


def set_kv_hook(attn_module: torch.nn.Module, hook: Callable | None) -> None:
    """hook(key [B, kv_heads, T, D] after RoPE, value [B, kv_heads, T, D]) -> (key, value)."""
    attn_module._qtk_kv_hook = hook


KV_ROUNDINGS = ("nearest", "toward_zero")


def fp8_toward_zero(y: torch.Tensor) -> torch.Tensor:
    """float32 -> the e4m3 value of largest magnitude not above |y| (saturating at ±448), as float32: round to
    nearest, then one code toward zero wherever that rounded away from zero (e4m3 codes of one sign are ordered
    by magnitude, subnormals included)."""
    c = y.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    away = c.float().abs() > y.abs()
    u = c.view(torch.uint8)
    u = torch.where(away, (u & 0x80) | ((u & 0x7F) - 1), u)
    return u.view(FP8_DTYPE).float()


def kv_fake_quant(kind: str, k_scale: float, v_scale: float, rounding: str = "nearest") -> Callable:
    """What the engine's cache stores and reads back: fp8(x / scale) * scale (vLLM FP8), or
    round(x / scale) clamped to int8, times scale (TensorRT-LLM INT8).

    rounding "toward_zero" is vLLM's CPU attention kernel (0.32): it multiplies by the reciprocal of the scale in
    float32 and truncates to e4m3 where the GPU kernels round to nearest (tests/engine: the bytes it writes)."""
    if rounding not in KV_ROUNDINGS:
        raise ValueError(f"unknown KV rounding {rounding!r}")

    def q(x, s):
        if rounding == "toward_zero" and kind == "fp8":
            inv = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(s, dtype=torch.float32)
            return fp8_toward_zero(x.float() * inv).mul_(s).to(x.dtype)
        y = x.float().div(s) if x.dtype != torch.float32 else x.div(s)
        if kind == "fp8":
            y = y.clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float()
        elif kind == "int8":
            y = y.round_().clamp_(-128, 127)
        else:
            raise ValueError(f"unknown KV cache kind {kind!r}")
        return y.mul_(s).to(x.dtype)

    return lambda key, value: (q(key, k_scale), q(value, v_scale))


def replace_module(root: torch.nn.Module, name: str, new: torch.nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, child, new)


def build_simulated_model(ckpt, *, simulate_activations: bool = True, simulate_kv: bool = True,
                          dtype: torch.dtype = torch.float32, kv_rounding: str = "nearest"):
    """The model a checkpoint describes, as the engine runs it: dequantized weights read from disk, each Linear's
    activations fake-quantized with the scheme and static scale its config gives that module (ckpt.scheme_for), and
    the KV cache with the checkpoint's own scales, rounded as `kv_rounding` says (kv_fake_quant). Module names come
    from the architecture table (ckpt.names)."""
    from qtk.model.source import config_from_dict, meta_skeleton

    config = config_from_dict(ckpt.hf_config)
    model = meta_skeleton(config, dtype=dtype)
    names = ckpt.names
    sd = {k: v.to(dtype) for k, v in ckpt.dense_state_dict().items()}
    modules = ckpt.modules()
    for members in fusion_members(modules, ckpt.arch.fusion_groups if ckpt.arch is not None else ()):
        qts = [ckpt.qtensor(m) for m in members]
        for m, w in zip(members, max_scale_weights(qts) or [engine_weight(qt) for qt in qts]):
            sd[f"{m}.weight"] = w.to(dtype)
    for m in modules:
        if f"{m}.weight" not in sd:
            sd[f"{m}.weight"] = engine_weight(ckpt.qtensor(m)).to(dtype)
    if getattr(config, "tie_word_embeddings", False) and f"{names.lm_head}.weight" not in sd:
        sd[f"{names.lm_head}.weight"] = sd[f"{names.embed}.weight"]
    expected = {k for k, v in model.state_dict().items() if v.is_meta}
    missing, unexpected = sorted(expected - set(sd)), sorted(set(sd) - set(model.state_dict()))
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match its config: missing {missing[:5]}, unexpected {unexpected[:5]}")
    model.load_state_dict(sd, strict=False, assign=True)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    for m in modules:
        lin = model.get_submodule(m)
        scheme = ckpt.scheme_for(m)
        act = scheme.engine_activations if (simulate_activations and scheme is not None) else None
        scale = ckpt.input_scale(m) if act is not None and act.has_static_scale else None
        replace_module(model, m, QLinear(lin.weight.detach(), None if lin.bias is None else lin.bias.detach(), act, scale,
                                         input_rotation=ckpt.input_rotation(m, lin.weight.shape[1])))
    # a checkpoint of a family qtk does not convert is simulated module by module
    fuse_groups(model, modules, ckpt.arch.fusion_groups if ckpt.arch is not None else ())
    use_qtk_attention(model)
    if simulate_kv and ckpt.kv_cache:
        for i, layer in enumerate(model.get_submodule(names.layers)):
            scales = ckpt.kv_scales(i)
            if scales is None:  # simulating without it would judge a model the engine never runs
                from qtk.errors import CheckFailed

                raise CheckFailed(f"{ckpt.kv_tensor_names(i)} missing although the config declares an {ckpt.kv_cache} "
                                  "KV cache", f"run qtk inspect {ckpt.path}")
            set_kv_hook(layer.get_submodule(names.attn), kv_fake_quant(ckpt.kv_cache, *scales, kv_rounding))
    return model.eval()
