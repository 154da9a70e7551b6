"""Sparse MoE blocks with one ordinary Linear per expert, named as in the checkpoint.

transformers 5 holds a block's experts as fused 3-D parameters (gate_up_proj [E, 2I, H], down_proj
[E, H, I]; gpt-oss: transposed, gate/up interleaved, with biases: the family's `FusedExperts`) and fuses the
checkpoint's per-expert tensors on load. qtk calibrates and quantizes each
expert's Linears separately (hooks, smoothing, GPTQ and the writers all see nn.Linear), so the skeleton's
fused experts are replaced by `ExpertMLP`s; the block (router, shared experts and their gate) is the model's
own module, so routing and the shared path are the model's own math.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def silu_glu(act):
    """act(gate) * up: the SwiGLU of Llama-style experts, with the model's own activation module."""
    return lambda g, u: act(g) * u


def clamped_swiglu(alpha: float, limit: float):
    """gpt-oss's expert activation (transformers' GptOssExperts._apply_gate on the split gate/up outputs): gate
    clamped above at `limit`, up to [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate)."""

    def glu(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        g = g.clamp(min=None, max=limit)
        u = u.clamp(min=-limit, max=limit)
        return (u + 1) * (g * torch.sigmoid(g * alpha))

    return glu


class ExpertMLP(nn.Module):
    """One expert: down(glu(gate(x), up(x))), with the checkpoint's Linear names (w1/w3/w2 or gate_proj/...)."""

    def __init__(self, names: tuple[str, str, str], hidden: int, inter: int, glu, device=None, dtype=None,
                 bias: bool = False):
        super().__init__()
        self.names = names
        gate, up, down = names
        self.add_module(gate, nn.Linear(hidden, inter, bias=bias, device=device, dtype=dtype))
        self.add_module(up, nn.Linear(hidden, inter, bias=bias, device=device, dtype=dtype))
        self.add_module(down, nn.Linear(inter, hidden, bias=bias, device=device, dtype=dtype))
        self.glu = glu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = (getattr(self, n) for n in self.names)
        return down(self.glu(gate(x), up(x)))


class UnfusedExperts(nn.ModuleList):
    """transformers' fused experts module (hidden [tokens, H], top-k indices and weights -> the weighted sum of the
    chosen experts' outputs) over per-expert Linears. The MoE block around it (router, shared experts, their gate)
    stays the model's own module, so routing and the shared path are the model's own math.

    `routed` [E] counts the tokens routed to each expert over every forward since the last reset_counts()."""

    def __init__(self, experts):
        super().__init__(experts)
        self.num_experts = len(self)
        self.routed = torch.zeros(self.num_experts, dtype=torch.long)

    def reset_counts(self) -> None:
        self.routed = torch.zeros(self.num_experts, dtype=torch.long)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        x = hidden_states  # [tokens, H]; top_k_index, top_k_weights [tokens, k]
        out = torch.zeros_like(x)
        with torch.no_grad():
            hit = F.one_hot(top_k_index, self.num_experts).permute(2, 1, 0)  # [E, k, tokens]
            counts = hit.sum(dim=(1, 2))
        self.routed = self.routed + counts.cpu()
        for e in counts.nonzero().flatten().tolist():  # an expert no token chose is not run (as in transformers)
            pos, tok = torch.where(hit[e])
            y = self[e](x[tok]) * top_k_weights[tok, pos, None]
            out.index_add_(0, tok, y.to(out.dtype))
        return out


class InputScaledExperts(UnfusedExperts):
    """Llama 4's experts module (transformers' Llama4TextExperts) over per-expert Linears: its block hands it every
    token once per expert, [E * tokens, H] expert-major, each already multiplied by the router's score for that
    expert, and sums what it returns over the experts. The score of an expert a token is not routed to is
    sigmoid(-inf) = 0, so that token's row is exactly zero, and an expert without biases maps it to zero: each expert
    runs on its nonzero rows only, the tokens routed to it scaled as the engine scales them (vLLM's fused MoE applies
    the router weight on the input), so its calibration statistics are the inputs it really gets. A routed token
    whose score underflows to 0 contributes nothing either way and is not counted."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        x = hidden_states.view(self.num_experts, -1, hidden_states.shape[-1])  # [E, tokens, H]
        out = torch.zeros_like(x)
        with torch.no_grad():
            routed = x.ne(0).any(dim=-1)  # [E, tokens]
            counts = routed.sum(dim=1)
        self.routed = self.routed + counts.cpu()
        for e in counts.nonzero().flatten().tolist():
            tok = routed[e].nonzero().flatten()
            out[e, tok] = self[e](x[e, tok]).to(out.dtype)
        return out.view(hidden_states.shape)


def unfuse_experts(model: nn.Module, arch) -> None:
    """In each decoder layer whose MLP is sparse, replace the block's fused experts by UnfusedExperts and register
    the block under the checkpoint's block name (Mixtral: block_sparse_moe), its router first and its experts
    next (the checkpoint's order; a dense layer of a family that mixes them is left as it is). The layer's forward
    keeps calling `self.mlp`, which then refers to the same module without registering it twice (state_dict and
    named_modules list each tensor once, under the checkpoint's name; Llama 4's `feed_forward` is both). New Linears are created on the fused
    parameters' device (meta for a skeleton), uninitialised."""
    m = arch.moe
    for layer in model.get_submodule(arch.layers):
        block = getattr(layer, m.module)
        fused = getattr(block, "experts", None)
        if fused is None or not hasattr(fused, "gate_up_proj"):
            continue  # a dense MLP layer
        E = fused.gate_up_proj.shape[0]
        H, two_i = fused.gate_up_proj.shape[1:] if m.fused.transposed else fused.gate_up_proj.shape[:0:-1]
        dev, dt = fused.gate_up_proj.device, fused.gate_up_proj.dtype
        glu = clamped_swiglu(fused.alpha, fused.limit) if m.activation == "clamped_swiglu" else silu_glu(fused.act_fn)
        experts = (InputScaledExperts if m.input_scaled else UnfusedExperts)(ExpertMLP((m.gate, m.up, m.down), H, two_i // 2, glu, dev, dt, bias=m.bias)
                                 for _ in range(E))
        order = [m.router, "experts", *(k for k in block._modules if k not in (m.router, "experts"))]
        mods = dict(block._modules, experts=experts)
        block._modules.clear()
        for k in order:
            block._modules[k] = mods[k]
        del layer._modules[m.module]
        layer.add_module(m.block, block)
        if m.block != m.module:
            object.__setattr__(layer, m.module, block)  # an unregistered alias: the forward reads self.mlp


def moe_blocks(layer: nn.Module, arch) -> dict[str, UnfusedExperts]:
    """The layer's routed experts by their MoE block's relative name (empty for dense architectures and layers)."""
    if arch.moe is None:
        return {}
    experts = getattr(getattr(layer, arch.moe.block, None), "experts", None)
    return {arch.moe.block: experts} if isinstance(experts, UnfusedExperts) else {}


def starved_experts(expert_tokens: dict[str, list[int]], min_tokens: int) -> dict[str, int]:
    """Full expert names that received fewer than min_tokens calibration tokens -> their count."""
    return {f"{block}.experts.{e}": n for block, counts in expert_tokens.items() for e, n in enumerate(counts) if n < min_tokens}


def report_starved_experts(expert_tokens: dict[str, list[int]], min_tokens: int) -> dict[str, int]:
    """Log a warning naming the experts calibration barely reached; returns them (see starved_experts)."""
    starved = starved_experts(expert_tokens, min_tokens)
    if starved:
        import logging

        logging.getLogger("qtk.moe").warning(
            "%d expert(s) received fewer than %d calibration tokens: %s. Their scales rest on little data "
            "(GPTQ rounds them to nearest; smoothing uses s = 1 for those with none); calibrate with more or more "
            "varied samples",
            len(starved), min_tokens, ", ".join(f"{k} ({v})" for k, v in starved.items()))
    return starved
