"""The online rotation step (TRANSFORM, qtk.recipe.params.OnlineRotateParams): QuaRot / SpinQuant's R4, a Hadamard
rotation of down_proj's input that the engine applies at run time.

In every layer down_proj's weight becomes W R (R orthogonal: qtk.quant.hadamard.RepeatedRotation), and its input is
rotated as it is read (x R): the product is unchanged, x R (W R)ᵀ = x Wᵀ. The solver that follows sees both in the
rotated frame: a forward pre-hook on down_proj rotates its input for every hook after it (GPTQ's Hessian, static
input ranges), and the QLinear swapped in for it keeps the rotation (qtk.model.simulate.QLinear.input_rotation),
so the next layer's inputs are what the engine computes. The written checkpoint holds W R quantized, and the
rotation as a compressed-tensors transform (qtk.export.codecs.ct_transform) that vLLM applies before the GEMM.
"""

from __future__ import annotations

import torch

from qtk.errors import UsageError
from qtk.quant.hadamard import RepeatedRotation
from qtk.recipe.params import OnlineRotateParams
from qtk.steps.context import LayerContext
from qtk.steps.records import OnlineRotateRecord
from qtk.steps.registry import register_step

# the attribute a Linear carries while its input is rotated (read by qtk.steps.swap.swap_in)
ROTATION_ATTR = "_qtk_input_rotation"


def down_proj_of(arch) -> str | None:
    """The Linear reading the MLP's gated product (down_proj), from the architecture's smoothing pairs: the pair
    whose previous Linear is not the attention's value projection. None when the family has no such pair."""
    pairs = [p for p in arch.smoothing if not p.prev_is_norm and not p.prev.startswith(arch.attn + ".")]
    return pairs[0].nexts[0] if len(pairs) == 1 and len(pairs[0].nexts) == 1 else None


def _width(cfg: dict) -> int:
    return int(cfg["intermediate_size"])


def rotation_for(cfg: dict, params: OnlineRotateParams) -> RepeatedRotation:
    return RepeatedRotation.for_width(_width(cfg), params.seed, params.block)


def check_source(source, params: OnlineRotateParams) -> None:
    """Refuse, before any work, a model the online rotation cannot be applied to."""
    mt = source.config_dict.get("model_type")
    rel = down_proj_of(source.arch)
    if source.arch.moe is not None or rel is None or "intermediate_size" not in source.config_dict:
        raise UsageError(f"the rotate_online step cannot rotate {mt}: it rotates a dense MLP's down_proj, which this "
                         "family does not have in every layer", "use a recipe without rotate_online for this model")
    if source.arch.multimodal:
        raise UsageError(f"the rotate_online step cannot rotate {mt}: vLLM matches transform targets by its own module "
                         "names, which differ from the checkpoint's for vision-language models",
                         "use a recipe without rotate_online for this model")
    name = f"{source.layer_prefix(0)}{rel}.bias"
    if name in source.weight_map:
        raise UsageError(f"the rotate_online step cannot rotate {mt}: its {rel} has a bias, and vLLM applies an online "
                         "transform only to a Linear without one (CompressedTensorsLinearTransformMethod.apply)",
                         "use a recipe without rotate_online for this model")
    try:
        r = rotation_for(source.config_dict, params)
        if params.modules == "all":
            hidden = int(source.config_dict["hidden_size"])
            heads = int(source.config_dict["num_attention_heads"])
            head_dim = int(source.config_dict.get("head_dim") or hidden // heads)
            for w in (hidden, heads * head_dim):
                r.tiling(w)
    except ValueError as e:
        raise UsageError(f"the rotate_online step cannot rotate {mt} (intermediate_size "
                         f"{_width(source.config_dict)}): {e}",
                         "set rotate_online block: 0, or an order that divides the width (a power of two)") from None


def source_view(source, params: OnlineRotateParams):
    """No tensor outside the layers changes: the source itself, checked before any work."""
    check_source(source, params)
    return source


def rotate_input(module: torch.nn.Module, r: RepeatedRotation) -> None:
    """Rotate `module`'s input for everything that runs on it from now on (its forward and every hook after this
    one), and mark it so the QLinear swapped in for it keeps the rotation."""
    def hook(_mod, args):
        x = args[0]
        return (r.apply(x).to(x.dtype), *args[1:])

    module.register_forward_pre_hook(hook, prepend=True)
    setattr(module, ROTATION_ATTR, r)


def run(ctx: LayerContext, params: OnlineRotateParams) -> OnlineRotateRecord:
    # the quantized Linears it applies to (an unquantized one gets none: nothing to flatten for a quantized GEMM)
    rels = list(ctx.targets) if params.modules == "all" else [r for r in [down_proj_of(ctx.arch)] if r in ctx.targets]
    if not rels:
        return OnlineRotateRecord()
    widths = {ctx.layer.get_submodule(t).weight.shape[1] for t in rels}
    r = RepeatedRotation.for_width(max(widths), params.seed, params.block)
    with torch.no_grad():
        for t in rels:
            mod = ctx.layer.get_submodule(t)
            rt = r.tiling(mod.weight.shape[1])
            src = ctx.master[t] if t in ctx.master else mod.weight.detach().float()
            w = rt.apply(src).float()
            if t in ctx.master:
                ctx.master[t] = w
            mod.weight.copy_(w)
            rotate_input(mod, rt)
    # one width: recorded as it is (the block is that width for a full R4); several: as the repeated block
    return OnlineRotateRecord(rels, (r if len(widths) == 1 else r.unit()).to_json())


register_step("rotate_online", source_view=source_view)(run)
