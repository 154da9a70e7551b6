"""The rotation step (TRANSFORM): offline Hadamard rotations folded into the weights (qtk.recipe.params.RotateParams,
the matrices in qtk.quant.hadamard), so the written checkpoint is an ordinary one of a rotated model.

R1 rotates the residual stream by one orthogonal R (hidden x hidden). An RMSNorm commutes with it once its scale is
folded into the Linears it feeds (‖xR‖ = ‖x‖), so in every layer:

  q/k/v, gate/up (the norms' readers)   W ← W diag(g) R      the norm's weight ← 1
  o_proj, down_proj (residual writers)  W ← Rᵀ W, b ← b R
  outside the layers (`RotatedSource`)  embeddings E ← E R, lm_head ← W diag(g_final) R, the final norm ← 1

R2 rotates each attention head's values by one head_dim x head_dim R₂: v_proj's rows of every KV head W_h ← R₂ᵀ W_h
(biases b_h ← b_h R₂), o_proj's columns of every attention head W[:, h] ← W[:, h] R₂; softmax mixes values within a
head, so attention outputs come out rotated by R₂ and o_proj takes them back.

The decoder layers are rotated one at a time by the step as the loop reaches them; the tensors outside them are
rotated where they are read (`RotatedSource`, the source the conversion reads through: qtk.steps.registry
source_view), so the calibration hidden states are in the rotated frame from layer 0 on. The step's record holds the
rotations (kind, seed, sizes) and the norm scales it folded: reframe puts a source weight into the rotated frame.
"""

from __future__ import annotations

import copy

import torch

from qtk.algorithms.rotate import layout_of, layout_problem, rotated_bias, rotated_weight
from qtk.errors import UsageError
from qtk.model.source import ModelSource
from qtk.quant.hadamard import Rotation
from qtk.recipe.params import RotateParams
from qtk.steps.context import LayerContext
from qtk.steps.records import RotateRecord
from qtk.steps.registry import register_step

ROW_CHUNK = 4096  # embedding / lm_head rows rotated at a time (float64): a 128k vocabulary is never whole in float64


def check_rotatable(source) -> None:
    """Refuse, before any work, a model whose layers the rotation cannot be folded into."""
    why = layout_problem(source.arch, source.config_dict.get("model_type"))
    if why is not None:
        raise UsageError(f"the rotate step cannot rotate {source.config_dict.get('model_type')}: {why}",
                         "use a recipe without rotate for this model (e.g. w4a16-gptq)")


def rotations(hidden: int, head_dim: int, params: RotateParams) -> tuple[Rotation, Rotation | None]:
    """R1 (hidden) and R2 (head_dim) of a run: R1's signs from the seed, R2's from the next seed."""
    return Rotation(hidden, params.seed), (Rotation(head_dim, params.seed + 1) if params.r2 else None)


def _head_dim(cfg: dict) -> int:
    return int(cfg.get("head_dim") or int(cfg["hidden_size"]) // int(cfg["num_attention_heads"]))


# ---------------------------------------------------------------------------------------------- the step

def run(ctx: LayerContext, params: RotateParams) -> RotateRecord:
    layer, arch = ctx.layer, ctx.arch
    lay = layout_of(arch)
    attn = layer.get_submodule(arch.attn)
    hidden = layer.get_submodule(next(iter(lay.readers))).weight.shape[0]
    r1, r2 = rotations(hidden, int(attn.head_dim), params)
    norms = {}
    with torch.no_grad():
        for n in lay.readers:
            w = layer.get_submodule(n).weight
            norms[n] = w.detach().to(torch.float64)
            w.fill_(1.0)
        linears = [m for rs in lay.readers.values() for m in rs] + list(lay.writers)
        if r2 is not None:
            linears += [lay.values, lay.output]
        for t in dict.fromkeys(linears):
            mod = layer.get_submodule(t)
            src = ctx.master[t] if t in ctx.master else mod.weight.detach().float()
            w = rotated_weight(src, t, arch, r1, r2, norms)
            if t in ctx.master:
                ctx.master[t] = w
            mod.weight.copy_(w)
            if getattr(mod, "bias", None) is not None:
                mod.bias.copy_(rotated_bias(mod.bias.detach(), t, arch, r1, r2))
    return RotateRecord(r1.to_json(), None if r2 is None else r2.to_json(),
                        {n: g.float().tolist() for n, g in norms.items()})


# ---------------------------------------------------------------------------------------------- outside the layers

class RotatedSource(ModelSource):
    """The source as the rotated model: the same files and layers (the step rotates those), with the embeddings,
    the final norm and lm_head read rotated. Where the embedding is tied to lm_head and the final norm is not all
    ones, the two differ once rotated: this source is untied (config tie_word_embeddings false, an lm_head.weight
    of its own), and `untied` says so."""

    def __init__(self, inner: ModelSource, r1: Rotation):
        self.__dict__.update(inner.__dict__)  # the same files, handles, config and skeleton: a view, not a copy
        self.inner, self.r1 = inner, r1
        arch = inner.arch
        self.embed_name, self.norm_name, self.head_name = (f"{arch.embed}.weight", f"{arch.final_norm}.weight",
                                                           f"{arch.lm_head}.weight")
        g = inner.tensor(self.norm_name).to(torch.float64)
        self.final_g = g
        # tied by the config (transformers then loads the embedding as lm_head, whether or not lm_head is stored too)
        tied = bool(getattr(inner.config, "tie_word_embeddings", False))
        self.head_stored = self.head_name in inner.weight_map
        self.untied = tied and not bool((g == 1).all())
        # what a checkpoint written from this source says about itself (its README and qtk.json notes)
        self.notes = [f"rotated (Hadamard R1 of {r1.size}: {r1.describe()}); lm_head untied from the embedding: the "
                      "final norm's scale is folded into lm_head, which the embedding does not share"] if self.untied else []
        if self.untied:
            self.config_dict = {**inner.config_dict, "tie_word_embeddings": False}
            cfg = copy.deepcopy(inner.config)
            cfg.tie_word_embeddings = False
            self.__dict__["config"] = cfg
            if not self.head_stored:
                self.weight_map = {**inner.weight_map, self.head_name: inner.weight_map[self.embed_name]}
        # else a tied lm_head (final norm all ones) is the rotated embedding itself: E diag(1) R = E R

    def _stored_name(self, name: str) -> str:
        return self.embed_name if name == self.head_name and not self.head_stored else name

    def non_layer_tensor_names(self) -> list[str]:
        names = self.inner.non_layer_tensor_names()
        return names + [self.head_name] if self.untied and not self.head_stored else names

    def shape(self, name: str) -> list[int]:
        return self.inner.shape(self._stored_name(name))

    def tensor_dtype(self, name: str) -> torch.dtype:
        return self.inner.tensor_dtype(self._stored_name(name))

    def tensor(self, name: str, mapped: bool = False) -> torch.Tensor:
        if name not in (self.embed_name, self.norm_name, self.head_name):
            return self.inner.tensor(name, mapped)
        t = self.inner.tensor(self._stored_name(name))
        if name == self.norm_name:
            return torch.ones_like(t)
        out = torch.empty_like(t)
        fold = self.final_g if name == self.head_name else None
        for i in range(0, t.shape[0], ROW_CHUNK):
            rows = t[i:i + ROW_CHUNK].to(torch.float64)
            out[i:i + ROW_CHUNK] = self.r1.apply(rows if fold is None else rows * fold).to(t.dtype)
        return out

    def stored(self, name: str, check=None):
        if name not in (self.embed_name, self.norm_name, self.head_name):
            return self.inner.stored(name, check)
        t = self.tensor(name)
        if check is not None:
            check(t)
        return t


def source_view(source, params: RotateParams):
    """The source the conversion reads through (qtk.steps.registry.register_step's source_view): rotated outside the
    layers. Refuses a family the rotation does not fold into, before any work."""
    if isinstance(source, RotatedSource):
        return source
    check_rotatable(source)
    hidden = int(source.config_dict["hidden_size"])
    r1, _ = rotations(hidden, _head_dim(source.config_dict), params)
    return RotatedSource(source, r1)


register_step("rotate", source_view=source_view)(run)
