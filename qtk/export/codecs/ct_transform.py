"""Online transforms in a compressed-tensors checkpoint: the `transform_config` inside `quantization_config` and the
tensors it needs, written and read back (the vllm writer and its reader).

As compressed-tensors (transform/: TransformConfig, TransformScheme, TransformArgs) and vLLM 0.32
(model_executor/layers/quantization/compressed_tensors/transform/) define them:

- `transform_config: {config_groups: {NAME: {type, apply: [{targets, location, inverse, ignore}], randomize,
  requires_grad, head_dim, precision}}}`. vLLM applies the online locations `input` and `output` on Linears
  (transform/linear.py get_linear_transform_schemes; any other online location, q_attn or k_cache, on a Linear is a
  ValueError there), one input transform per (fused) module.
- The matrix is a tensor beside the module, `<module>.<NAME>_input.weight` [b, b] (b = head_dim, else the input
  width), stored unnormalised (±1 for a Hadamard): vLLM divides it by √b after loading (module.py
  process_weights_after_loading) and, for every type but `hadamard`, computes x M/√b as a dense GEMM (M/√b
  transposed with `inverse`), repeated over the blocks when head_dim is smaller than the width. Type `hadamard`
  ignores the stored matrix and runs the hadacore kernel (a Sylvester matrix, CUDA only); qtk writes
  `random-hadamard`, so the matrix on disk is the one applied, whatever its order.
- vLLM keeps one tensor per (scheme, size) for the whole model (parameter.py SharedWeightParameter's registry keyed
  by id(scheme) and size): every module of a group must store the same matrix. `randomize` would add a permutation
  compressed-tensors stores and vLLM ignores: always false.
"""

from __future__ import annotations

from dataclasses import dataclass

from qtk.quant.lazy import torch  # the planner counts these tensors without importing torch

GROUP = "R4"  # the config group's name for down_proj's rotation; the tensors are <module>.R4_input.weight
GROUP_ALL = "HG"  # for every Linear's input rotated within blocks (a Hadamard within groups)


def group_for(modules: list[str]) -> str:
    return GROUP if all(m.endswith("down_proj") for m in modules) else GROUP_ALL
TYPE = "random-hadamard"


def tensor_name(module: str, group: str = GROUP, location: str = "input") -> str:
    return f"{module}.{group}_{location}.weight"


def transform_config(modules: list[str], block: int, width: int) -> dict:
    """The transform_config of one online input rotation of `modules` (full names) with a [block, block] matrix;
    head_dim unset when the matrix is the whole input (block == width)."""
    return {"config_groups": {group_for(modules): {
        "type": TYPE,
        "apply": [{"targets": sorted(modules), "location": "input", "inverse": False, "ignore": []}],
        "randomize": False,
        "requires_grad": False,
        "head_dim": None if block == width else block,
        "precision": "torch.float32",
    }}}


@dataclass(frozen=True)
class InputTransform:
    """One module's online input transform as a checkpoint declares it: the stored matrix's name, its order, and
    whether it is applied transposed."""

    group: str
    kind: str
    tensor: str
    block: int | None  # head_dim; None: the module's input width
    inverse: bool


def input_transforms(tconfig: dict | None, modules: list[str]) -> tuple[dict[str, InputTransform], list[str]]:
    """module -> its input transform, for the modules the config's targets name (exact names, or `re:` patterns
    matched as compressed-tensors does); and the problems with the config (what vLLM would refuse or apply
    otherwise than qtk reads it)."""
    from qtk.bounds import match as bounded_match

    out: dict[str, InputTransform] = {}
    problems: list[str] = []
    for name, g in ((tconfig or {}).get("config_groups") or {}).items():
        kind = g.get("type")
        if g.get("randomize"):
            problems.append(f"transform {name}: randomize is set, a permutation vLLM does not apply")
        for args in g.get("apply") or []:
            loc = args.get("location")
            targets = args.get("targets") or []
            targets = [targets] if isinstance(targets, str) else list(targets)
            ignore = args.get("ignore") or []
            ignore = [ignore] if isinstance(ignore, str) else list(ignore)

            def hit(m, pats):
                # a target is a module's name, a `re:` pattern, or a class name: every module read here is a Linear
                # (llm-compressor's QuIP writes targets ["Linear"])
                return any(m == t or t == "Linear" or (t.startswith("re:") and bounded_match(t[3:], m)) for t in pats)

            chosen = [m for m in modules if hit(m, targets) and not hit(m, ignore)]
            if loc in ("weight_input", "weight_output"):
                continue  # offline: folded into the weights before they were written, nothing at run time
            if loc != "input":
                problems.append(f"transform {name}: location {loc} is not an input rotation qtk simulates "
                                "(vLLM 0.32 applies input and output transforms on Linears only)")
                continue
            if not chosen:
                problems.append(f"transform {name}: its targets match no quantized Linear")
            for m in chosen:
                if m in out:
                    problems.append(f"{m}: two input transforms ({out[m].group}, {name}); vLLM applies one per module")
                out[m] = InputTransform(name, kind, tensor_name(m, name, loc), g.get("head_dim"),
                                        bool(args.get("inverse")))
    return out, problems


class DenseRotation:
    """An input transform read from a checkpoint, applied as the engine applies it: x blockdiag(M, ...) with M the
    stored matrix divided by √b (transposed when the transform is an inverse), over each block of b channels. In
    float32 (float64 for a float64 input): the engine's GEMM runs in the model dtype, far coarser, and a dense
    float64 product of a 1536-wide input per down_proj would cost the simulation more than the rest of the layer."""

    def __init__(self, stored: "torch.Tensor", inverse: bool = False):
        m = stored.to(torch.float64) / float(stored.shape[0]) ** 0.5
        self.m = m.T.contiguous() if inverse else m
        self.block = stored.shape[0]

    def apply(self, x: "torch.Tensor") -> "torch.Tensor":
        lead, n = x.shape[:-1], x.shape[-1]
        if n % self.block:
            raise ValueError(f"an input transform of order {self.block} cannot tile an input of width {n}")
        dt = torch.float64 if x.dtype == torch.float64 else torch.float32
        y = x.to(dt).reshape(*lead, n // self.block, self.block) @ self.m.to(device=x.device, dtype=dt)
        return y.reshape(*lead, n)
