"""Which Linears of each layer a recipe quantizes, and the recipe checked against the model before any work: ignore
patterns and override targets that name no Linear, fused groups split by ignore or given two schemes, group sizes
that do not divide a Linear's input size."""

from __future__ import annotations

import math

from qtk.errors import UsageError
from qtk.recipe import Recipe, matches


def target_linears(source, recipe: Recipe, i: int) -> list[str]:
    """The layer's Linears (relative names) that the recipe quantizes; an ignore that splits a fused
    group (q/k/v, gate/up) is refused, since engines fuse those into one GEMM."""
    arch = source.arch
    prefix = source.layer_prefix(i)
    kept = [r for r in arch.linears if not matches(prefix + r, recipe.ignore)]
    for g in arch.fusion_groups:
        inside = [m for m in g if m in kept]
        if inside and len(inside) != len(g):
            raise UsageError(f"ignore splits the fused group {', '.join(g)} in layer {i}",
                             "ignore all of q/k/v (or gate/up) together, or none")
        if len({recipe.scheme_for(prefix + m) for m in inside}) > 1:
            raise UsageError(f"recipe {recipe.name}: overrides give the fused group {', '.join(g)} of layer {i} different "
                             "schemes, but the engines run it as one GEMM with one scheme",
                             "target all of q/k/v (or gate/up) with the same override, or none of them")
    return kept


def check_ignore(source, recipe: Recipe) -> None:
    """Before any work: every ignore pattern names at least one Linear of the model (a typo would otherwise
    quantize what the user meant to keep), lm_head is among the ignored (qtk quantizes decoder-layer Linears
    only and writes lm_head in 16 bits, so a recipe that does not ignore it would not say what happens), and
    no layer's fused group is split by ignore or given two schemes by overrides; every override target names a
    Linear too."""
    arch = source.arch
    linears = [source.layer_prefix(i) + m for i in range(source.num_layers) for m in (*arch.linears, *arch.dense_linears)]
    linears.append(arch.lm_head)
    for p in recipe.ignore:
        if not any(matches(n, (p,)) for n in linears):
            raise UsageError(f"recipe {recipe.name}: ignore pattern {p!r} matches no Linear of this {arch.name} model",
                             f"fix or remove it; Linears are named like {linears[0]} or {arch.lm_head} "
                             "(a dotted suffix such as 'mlp.down_proj', or 're:' and a full-match regex)")
    for k, o in enumerate(recipe.overrides):
        for p in o.targets:
            if not any(matches(n, (p,)) for n in linears):
                raise UsageError(f"recipe {recipe.name}: overrides[{k}] target {p!r} matches no Linear of this {arch.name} model",
                                 f"fix or remove it; Linears are named like {linears[0]} "
                                 "(a dotted suffix such as 'mlp.down_proj', or 're:' and a full-match regex)")
    if not matches(arch.lm_head, recipe.ignore):
        raise UsageError(f"recipe {recipe.name}: ignore does not list {arch.lm_head}, but qtk keeps {arch.lm_head} in 16 bits "
                         "(it quantizes the decoder layers' Linears only)",
                         f"add {arch.lm_head} to the recipe's ignore list, e.g. 'ignore: [{arch.lm_head}]'")
    for i in range(source.num_layers):
        target_linears(source, recipe, i)


GROUP_SIZES = (256, 128, 64, 32, 16)  # what the engines' group-wise kernels are built for, largest first


def check_group_size(source, recipe: Recipe) -> None:
    """Every targeted Linear's in_features (from the safetensors headers, no data read) must be a multiple of the
    group size of its scheme; refused before any work, suggesting only group sizes that divide every Linear that
    scheme covers."""
    by_group: dict[int, dict[int, str]] = {}  # group size -> in_features -> the first Linear with it
    fixed: set[int] = set()  # group sizes a format fixes (NVFP4 16, MX 32): no other size to suggest
    for i in range(source.num_layers):
        prefix = source.layer_prefix(i)
        for t in target_linears(source, recipe, i):
            w = recipe.scheme_for(prefix + t).weights
            name = f"{prefix}{t}.weight"
            if w.strategy not in ("group", "tensor_group", "block") or name not in source.weight_map:
                continue  # the skeleton check names missing tensors
            shape = source.shape(name)
            if len(shape) != 2:
                continue
            if w.strategy == "block":
                _check_blocks(prefix + t, [int(x) for x in shape], w)
                continue
            if w.type == "float":
                fixed.add(w.group_size)
            by_group.setdefault(w.group_size, {}).setdefault(int(shape[1]), prefix + t)
    for group_size, sizes in by_group.items():
        bad = {n: m for n, m in sizes.items() if n % group_size}
        if not bad:
            continue
        n, m = min(bad.items())
        if group_size in fixed:
            raise UsageError(f"the FP4/MX groups of {group_size} do not divide in_features {n} of {m}",
                             "ignore the Linears that do not fit (recipe ignore:), or use an int recipe")
        common = math.gcd(*sizes)
        fits = [g for g in GROUP_SIZES if common % g == 0 and g != group_size][:2]
        fix = (f"use group_size {' or '.join(map(str, fits))} (they divide every quantized Linear's input size: "
               f"{', '.join(map(str, sorted(sizes)))})" if fits else
               f"no group size of {', '.join(map(str, GROUP_SIZES))} divides every input size ({', '.join(map(str, sorted(sizes)))}): "
               "use strategy: channel, or ignore the Linears that do not fit")
        raise UsageError(f"group_size {group_size} does not divide in_features {n} of {m}", fix)


def _check_blocks(module: str, shape: list[int], w) -> None:
    """FP8 blocks must tile the weight: vLLM refuses a fused part or a shard that is not a multiple of the block
    (validate_fp8_block_shape) and transformers' FP8 loader derives the block from the scale grid, so a ragged
    weight would decode wrong there."""
    bm, bn = w.block_structure
    out_f, in_f = shape
    if out_f % bm or in_f % bn:
        raise UsageError(f"FP8 blocks of {bm}x{bn} do not tile {module} ([{out_f}, {in_f}]): vLLM refuses ragged "
                         "blocks", "ignore the Linears that do not fit (recipe ignore:), or use fp8-dynamic "
                         "(per-channel FP8, any shape)")
