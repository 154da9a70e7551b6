"""Sparse MoE blocks with one ordinary Linear per expert, named as in the checkpoint.

transformers 5 holds a block's experts as fused 3-D parameters (gate_up_proj [E, 2I, H], down_proj
[E, H, I]) and fuses the checkpoint's per-expert tensors on load. qtk calibrates and quantizes each
expert's Linears separately (hooks, smoothing, GPTQ and the writers all see nn.Linear), so the skeleton's
fused experts are replaced by `ExpertMLP`s; the router is the model's own module, so routing is the
model's own math.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ExpertMLP(nn.Module):
    """One expert: down(act(gate(x)) * up(x)), with the checkpoint's Linear names (w1/w3/w2 or gate_proj/...)."""

    def __init__(self, names: tuple[str, str, str], hidden: int, inter: int, act, device=None, dtype=None):
        super().__init__()
        self.names = names
        gate, up, down = names
        self.add_module(gate, nn.Linear(hidden, inter, bias=False, device=device, dtype=dtype))
        self.add_module(up, nn.Linear(hidden, inter, bias=False, device=device, dtype=dtype))
        self.add_module(down, nn.Linear(inter, hidden, bias=False, device=device, dtype=dtype))
        self.act_fn = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = (getattr(self, n) for n in self.names)
        return down(self.act_fn(gate(x)) * up(x))


class UnfusedMoE(nn.Module):
    """transformers' sparse MoE block (router -> top-k experts -> weighted sum) over per-expert Linears.

    `routed` [E] counts the tokens routed to each expert over every forward since the last reset_counts()."""

    def __init__(self, router: nn.Module, experts: nn.ModuleList, router_name: str = "gate"):
        super().__init__()
        self.router_name = router_name
        self.add_module(router_name, router)
        self.experts = experts
        self.num_experts = len(experts)
        self.routed = torch.zeros(self.num_experts, dtype=torch.long)

    def reset_counts(self) -> None:
        self.routed = torch.zeros(self.num_experts, dtype=torch.long)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])  # x [tokens, H]
        _, top_w, top_i = getattr(self, self.router_name)(x)  # top_w, top_i [tokens, k]
        out = torch.zeros_like(x)
        with torch.no_grad():
            hit = F.one_hot(top_i, self.num_experts).permute(2, 1, 0)  # [E, k, tokens]
            counts = hit.sum(dim=(1, 2))
        self.routed = self.routed + counts.cpu()
        for e in counts.nonzero().flatten().tolist():  # an expert no token chose is not run (as in transformers)
            pos, tok = torch.where(hit[e])
            y = self.experts[e](x[tok]) * top_w[tok, pos, None]
            out.index_add_(0, tok, y.to(out.dtype))
        return out.reshape(shape)


def unfuse_experts(model: nn.Module, arch) -> None:
    """Replace each decoder layer's fused MoE block (transformers' `mlp`) by an UnfusedMoE registered under
    the checkpoint's block name (Mixtral: block_sparse_moe). The layer's forward keeps calling `self.mlp`,
    which then refers to the same module without registering it twice (state_dict and named_modules list
    each tensor once, under the checkpoint's name). New Linears are created on the fused parameters' device
    (meta for a skeleton), uninitialised."""
    m = arch.moe
    for layer in model.get_submodule(arch.layers):
        block = layer.mlp
        fused = block.experts
        E, two_i, H = fused.gate_up_proj.shape
        dev, dt = fused.gate_up_proj.device, fused.gate_up_proj.dtype
        experts = nn.ModuleList(ExpertMLP((m.gate, m.up, m.down), H, two_i // 2, fused.act_fn, dev, dt) for _ in range(E))
        new = UnfusedMoE(getattr(block, m.router), experts, m.router)
        del layer._modules["mlp"]
        layer.add_module(m.block, new)
        if m.block != "mlp":
            object.__setattr__(layer, "mlp", new)  # an unregistered alias: the forward reads self.mlp


def moe_blocks(layer: nn.Module, arch) -> dict[str, UnfusedMoE]:
    """The layer's MoE blocks by relative name (empty for dense architectures)."""
    return {} if arch.moe is None else {arch.moe.block: layer.get_submodule(arch.moe.block)}


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
            "(none: GPTQ falls back to RTN, smoothing uses s = 1); calibrate with more or more varied samples",
            len(starved), min_tokens, ", ".join(f"{k} ({v})" for k, v in starved.items()))
    return starved
