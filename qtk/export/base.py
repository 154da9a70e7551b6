"""What every writer shares: construction, side files (tokenizer, generation config), the manifest."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from qtk.export import ExportOptions


class Writer:
    target = ""
    description = ""
    loads_in = ""  # which engines load this output (README, --help)

    def __init__(self, directory: Path, source, recipe, options: ExportOptions):
        self.dir = Path(directory)
        self.source = source
        self.recipe = recipe
        self.options = options
        self.notes: list[str] = list(self.check(source, recipe, options))

    @classmethod
    def check(cls, source, recipe, options: ExportOptions) -> list[str]:
        """Refuse (UsageError) what this target cannot express, before any work; return notes for the user."""
        return []

    def add_dense(self, name: str, tensor) -> None:
        raise NotImplementedError

    def add_layer(self, result) -> None:
        raise NotImplementedError

    def finish(self, manifest: dict) -> None:
        raise NotImplementedError

    def copy_side_files(self) -> None:
        for p in self.source.tokenizer_files:
            shutil.copy2(p, self.dir / p.name)
        gen = self.source.path / "generation_config.json"
        if gen.is_file():
            shutil.copy2(gen, self.dir / gen.name)

    def write_manifest(self, manifest: dict) -> None:
        m = {**manifest, "target": self.target, "notes": self.notes}
        (self.dir / "qtk.json").write_text(json.dumps(m, indent=2, default=str) + "\n")
