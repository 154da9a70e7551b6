"""Which Linears of each layer a recipe quantizes, and the recipe checked against the model before any work: ignore
patterns and override targets that name no Linear, fused groups split by ignore or given two schemes, group sizes
that do not divide a Linear's input size, FP8 blocks the target's engine cannot run (qtk itself quantizes FP8 blocks
of any shape: the last block row and column may be partial; the writers call check_fp8_blocks / check_fp8_tiles)."""

from __future__ import annotations

import math

from qtk.errors import UsageError
from qtk.recipe import Recipe, matches


def target_linears(source, recipe: Recipe, i: int) -> list[str]:
    """The layer's Linears (relative names) that the recipe quantizes; an ignore that splits a fused
    group (q/k/v, gate/up) is refused, since engines fuse those into one GEMM."""
    arch = source.arch.at(i)
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
    linears = [source.layer_prefix(i) + m for i in range(source.num_layers)
               for m in (*arch.at(i).linears, *arch.at(i).dense_linears)]
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


def check_kv_cache(source, recipe: Recipe) -> None:
    """Before any work: a recipe that quantizes the KV cache of a family whose cache is not per-head K and V (MLA's
    compressed latent) is refused; qtk calibrates K and V scales per attention layer."""
    why = source.arch.kv_cache_refusal
    if recipe.kv_cache is not None and why is not None:
        raise UsageError(f"recipe {recipe.name} quantizes the KV cache, but this {source.arch.name} model's attention is "
                         f"MLA: {why}",
                         "use the recipe without KV-cache quantization (e.g. w8a8-sq for int8-kv8, fp8 for fp8-kv8)")


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
            if w.strategy not in ("group", "tensor_group") or name not in source.weight_map:
                continue  # the skeleton check names missing tensors
            shape = source.shape(name)
            if len(shape) != 2:
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



PREFUSED = ("self_attn.qkv_proj", "mlp.gate_up_proj")  # Phi-3 stores these fused: vLLM still runs them as parts
ROW_PARALLEL = ("self_attn.o_proj", "mlp.down_proj")  # vLLM's RowParallelLinear: tp splits their inputs


def fp8_block_gemms(source, recipe, i: int):
    """The FP8-block GEMMs vLLM runs for layer i: (member Linears in vLLM's order, their [out, in] shapes, how tp
    splits the GEMM, the K/V parts' head count or None), from the safetensors headers (no data read)."""
    arch = source.arch
    prefix = source.layer_prefix(i)
    shapes = {}
    for t in target_linears(source, recipe, i):
        w = recipe.scheme_for(prefix + t).weights
        name = f"{prefix}{t}.weight"
        if w.strategy == "block" and name in source.weight_map and len(source.shape(name)) == 2:
            shapes[t] = tuple(int(x) for x in source.shape(name))
    done: set[str] = set()
    for members, _ in arch.vllm_fused:
        if all(m in shapes for m in members):
            done.update(members)
            yield members, [shapes[m] for m in members], "column"
    for t, shape in shapes.items():
        if t in done:
            continue
        if ".experts." in t:
            yield (t,), [shape], "experts"
        elif t in ROW_PARALLEL or (arch.moe is not None and t.endswith(f".{arch.moe.down}")):
            # an MoE family's dense-layer and shared-expert MLPs (Llama 4's feed_forward.down_proj) are vLLM MLPs too
            yield (t,), [shape], "row"
        else:
            yield (t,), [shape], "column"


def _prefused_parts(source, t: str, out: int) -> list[int]:
    """The parts vLLM splits a checkpoint's pre-fused Linear into (Phi-3's qkv_proj: q, k, v; gate_up_proj: gate, up)."""
    c = source.config_dict
    if t == "mlp.gate_up_proj":
        return [out // 2, out // 2]
    heads = int(c["num_attention_heads"])
    kv = int(c.get("num_key_value_heads") or heads)
    hd = out // (heads + 2 * kv)
    return [heads * hd, kv * hd, kv * hd]


def check_fp8_blocks(source, recipe, tp: int = 1) -> None:
    """Before any work: vLLM can run every FP8-block Linear of the recipe at tensor-parallel size tp
    (qtk.model.config_check.fp8_block_misfit: vLLM's validate_fp8_block_shape, inputs in whole activation groups).
    Refused naming the first Linear at fault, its shape, the rule and the fix."""
    from qtk.model.config_check import fp8_block_misfit

    c = source.config_dict
    kv_heads = int(c.get("num_key_value_heads") or c.get("num_attention_heads") or 1)
    for i in range(source.num_layers):
        prefix = source.layer_prefix(i)
        for members, shapes, split in fp8_block_gemms(source, recipe, i):
            block = tuple(recipe.scheme_for(prefix + members[0]).weights.block_structure)
            parts, in_f = [s[0] for s in shapes], shapes[0][1]
            if len(members) == 1 and members[0] in PREFUSED:
                parts = _prefused_parts(source, members[0], parts[0])
            shard_parts = None
            if split == "column" and tp > 1 and kv_heads < tp and len(parts) == 3:  # K/V heads copied, one per rank
                shard_parts = [parts[0] // tp, parts[1] // kv_heads, parts[2] // kv_heads]
            if split == "experts":
                # gate/up: outputs split over tp (w13); down: inputs split (w2); checked per shard
                if members[0].endswith(source.arch.moe.down):
                    miss = fp8_block_misfit(parts, in_f // tp, block, 1, split="experts")
                else:
                    miss = fp8_block_misfit([p // tp for p in parts], in_f, block, 1, split="experts")
            else:
                miss = fp8_block_misfit(parts, in_f, block, tp, split=split, shard_parts=shard_parts)
            if miss is None:
                continue
            k, why = miss
            m = members[min(k, len(members) - 1)]
            bm, bn = block
            at = f" at tp {tp}" if tp > 1 else ""
            raise UsageError(f"FP8 blocks of {bm}x{bn}: vLLM cannot run {prefix}{m} {list(shapes[min(k, len(shapes) - 1)])}"
                             f"{at}: {why}",
                             "ignore it (recipe ignore:; q/k/v and gate/up go together), or use fp8-dynamic "
                             "(per-channel FP8, any shape)")


def check_fp8_tiles(source, recipe, why: str) -> None:
    """Before any work: the recipe's FP8 blocks tile every block-quantized Linear (for formats whose loader derives
    the block from the scale grid)."""
    for i in range(source.num_layers):
        prefix = source.layer_prefix(i)
        for members, shapes, _ in fp8_block_gemms(source, recipe, i):
            bm, bn = recipe.scheme_for(prefix + members[0]).weights.block_structure
            for m, (out_f, in_f) in zip(members, shapes):
                if out_f % bm or in_f % bn:
                    raise UsageError(f"FP8 blocks of {bm}x{bn} do not tile {prefix}{m} ([{out_f}, {in_f}]): {why}",
                                     "ignore the Linears that do not fit (recipe ignore:), or use "
                                     "fp8-dynamic (per-channel FP8, any shape)")


def check_source_format(source, recipe: Recipe) -> None:
    """A source already quantized (qtk.model.prequantized: FP8 blocks, gpt-oss's MXFP4 experts) converted to its own
    format is refused: its weights would be rounded a second time onto the grid they came from (the dequantized
    values rounded back in the model dtype, not bit for bit the source's codes), for a checkpoint the engines already
    serve as it is."""
    quant = getattr(source, "quant", None)
    if quant is None:
        return
    same = [s.weights for s in recipe.schemes if quant.same_format(s.weights)]
    if same:
        raise UsageError(f"{source.path.name} {quant.same_format_problem(recipe.name)}",
                         "serve the source as it is (vLLM and SGLang load it), or pick a recipe of another format")
