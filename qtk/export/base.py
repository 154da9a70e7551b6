"""What every writer shares: construction, side files (tokenizer, generation config), the manifest."""

from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path

from qtk.export import ExportOptions


class Writer:
    target = ""
    description = ""
    loads_in = ""  # which engines load this output (README, --help)
    serves_with: tuple[str, ...] = ("vllm",)  # whose serving commands the output's README shows

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

    def add_dense(self, name: str, tensor) -> None:
        raise NotImplementedError

    def add_layer(self, result) -> None:
        raise NotImplementedError

    def finish(self, manifest: dict) -> None:
        raise NotImplementedError

    def copy_side_files(self) -> None:
        for p in self.source.checked_side_files():  # checked again: a link may have changed since the start
            shutil.copy2(p, self.dir / p.name)

    def write_readme(self, manifest: dict, final: Path, gpu: str = "h100-80g", context: int = 4096, concurrency: int = 8) -> None:
        """README.md of the output: what it is, what loads it, and the serving flags that keep the KV cache in bounds."""
        from qtk.plan import serving_section

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
