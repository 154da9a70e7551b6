"""What every writer shares: construction, each module's scheme, side files (tokenizer, generation config), the
manifest."""

from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path

from qtk.export import ExportOptions
from qtk.recipe.rules import ModuleScheme


def planned_schemes(source, recipe) -> dict[str, ModuleScheme]:
    """Every decoder-layer Linear the recipe quantizes, with its scheme (recipe.scheme_for), before any work: what a
    writer's check judges a mixed-precision recipe by."""
    out = {}
    for i in range(source.num_layers):
        prefix = source.layer_prefix(i)
        for lin in source.arch.at(i).linears:
            s = recipe.scheme_for(prefix + lin)
            if s is not None:
                out[prefix + lin] = s
    return out


def layer_prefix_of(module: str, arch) -> str:
    """The decoder-layer prefix of a module's full name ("model.layers.3." for "model.layers.3.mlp.down_proj")."""
    layers = arch.layers + "."
    return layers + module[len(layers):].partition(".")[0] + "."


def override_patterns(modules: list[str], arch) -> tuple[list[str], list[str]]:
    """How a rule names exactly `modules` for the engines: (names, regexes). Modules of a fusion group that vLLM loads
    as one module (q/k/v as self_attn.qkv_proj) are named by one anchored regex that matches the members and the
    fused module (vLLM looks the fused module up by its own name); every other module by its exact name."""
    import re

    names = set(modules)
    regexes: list[str] = []
    fused: set[str] = set()
    for prefix in dict.fromkeys(layer_prefix_of(m, arch) for m in modules):
        for group, fused_name in arch.vllm_fused:
            members = [prefix + m for m in group]
            if all(m in names for m in members):
                regexes.append(f"^{re.escape(prefix)}(?:{'|'.join(re.escape(x) for x in (*group, fused_name))})$")
                fused.update(members)
    return sorted(names - fused), regexes


def expert_overrides(source, recipe) -> list[str]:
    """MoE expert Linears the recipe gives a scheme other than its default (the engines run a layer's experts as one
    fused kernel with one scheme)."""
    if source.arch.moe is None or not recipe.mixed:
        return []
    return [m for m, s in planned_schemes(source, recipe).items() if ".experts." in m and s != recipe.default_scheme]


class Writer:
    target = ""
    description = ""
    loads_in = ""  # which engines load this output (README, --help)
    serves_with: tuple[str, ...] = ("vllm",)  # whose serving commands the output's README shows
    # writes vision-language models (the vision tower and projector excluded from quantization by pattern)
    multimodal = False
    # writes transforms the engine applies at run time (an online rotation's matrices and their config)
    online_transforms = False

    def __init__(self, directory: Path, source, recipe, options: ExportOptions):
        self.dir = Path(directory)
        self.source = source
        self.recipe = recipe
        self.options = options
        self.notes: list[str] = list(self.check(source, recipe, options))

    @classmethod
    def check(cls, source, recipe, options: ExportOptions) -> list[str]:
        """Refuse (UsageError) what this target cannot express, before any work; return notes for the user.
        A refusal only another target can answer leaves its fix None: the caller names the targets that accept."""
        return []

    def module_scheme(self, module: str, qt) -> ModuleScheme:
        """The scheme `module` was quantized with: its QTensor's weight scheme (the truth the pipeline produced) and
        the activations the recipe gives it."""
        return ModuleScheme(qt.scheme, self.recipe.scheme_for(module).activations)

    def add_dense(self, name: str, tensor) -> None:
        """A tensor written as it is: a torch.Tensor, or a qtk.io.safetensors.StoredTensor (its bytes in the source
        file, which ShardedWriter.add copies in chunks; a writer that reshapes or converts it reads it whole with
        qtk.io.safetensors.as_tensor)."""
        raise NotImplementedError

    def add_layer(self, result) -> None:
        raise NotImplementedError

    def open_files(self) -> list:
        """The files this writer is still writing, to be written back while it goes on (qtk.io.atomic.WriteBack)."""
        shards = getattr(self, "shards", None)
        return shards.open_files() if shards is not None else []

    def checked_in_place(self) -> set[str]:
        """Dense tensors whose check (qtk.pipeline.loop.write_non_layer's NaN/Inf scan) saw their bytes where they
        lie in this output's files: copied by the kernel as stored, then scanned mapped from the shard
        (qtk.io.safetensors.ShardedWriter.checked_in_place). The convert self-check does not scan them again."""
        shards = getattr(self, "shards", None)  # the writers of one set of shards; TensorRT-LLM's re-lays them out
        return shards.checked_in_place if shards is not None else set()

    def finish(self, manifest: dict) -> None:
        raise NotImplementedError

    def write_config(self) -> None:
        """config.json: the source model's config with this target's quantization_config."""
        cfg = dict(self.source.config_dict)
        cfg["quantization_config"] = self.quantization_config()
        (self.dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")

    def copy_side_files(self) -> None:
        for p in self.source.checked_side_files():  # checked again: a link may have changed since the start
            shutil.copy2(p, self.dir / p.name)

    def write_readme(self, manifest: dict, final: Path, gpu: str | None = None, context: int = 4096, concurrency: int = 8) -> None:
        """README.md of the output: what it is, what loads it, and the serving flags that keep the KV cache in bounds.
        gpu: the plan's GPU; by default a B200 for FP4 recipes (only Blackwell runs FP4 natively), else an H100."""
        from qtk.plan import serving_section
        from qtk.plan.serving import default_gpu

        gpu = gpu or default_gpu(self.recipe)

        r = manifest["recipe"]
        ctx = min(context, int(self.source.config_dict.get("max_position_embeddings") or context))
        lines = [
            f"# {self.source.path.name} — {r['name']} ({self.target})",
            "",
            f"Written by qtk {manifest['qtk_version']} from `{self.source.path}` with recipe `{r['name']}`: {r['summary']}.",
            f"Format: {self.description}. Loads in: {self.loads_in}.",
            "",
        ]
        lines += [f"- note: {n}" for n in self.notes]
        q = shlex.quote  # paths go into commands to copy and paste: spaces or $(...) must stay one literal argument
        lines += ["", f"Check it: `qtk inspect {q(str(final))}` — gate it: "
                      f"`qtk eval {q(str(final))} --baseline {q(str(self.source.path))} --tasks tasks.yaml`.",
                  "", f"The serving plan below assumes {gpu}; run `qtk plan` for your hardware.", "",
                  serving_section(self.source.config_dict, self.recipe, gpu=gpu, context=ctx, concurrency=concurrency,
                                  tp=self.options.tp, model_path=str(final),
                                  trtllm_checkpoint=str(final), engines=self.serves_with)]
        (self.dir / "README.md").write_text("\n".join(lines).rstrip() + "\n")

    def write_manifest(self, manifest: dict) -> None:
        m = {**manifest, "target": self.target, "notes": self.notes}
        (self.dir / "qtk.json").write_text(json.dumps(m, indent=2, default=str) + "\n")
