"""Benchmarks and scripts run by hand, so nothing else notices when a qtk name they import moves: every
`from qtk... import name` in benchmarks/ and scripts/ must resolve against today's package."""

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FILES = sorted([*ROOT.glob("benchmarks/*.py"), *ROOT.glob("scripts/*.py")])


def _qtk_imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "qtk":
            for alias in node.names:
                yield node.module, alias.name
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "qtk":
                    yield alias.name, None


@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(ROOT)) for p in FILES])
def test_qtk_names_resolve(path):
    missing = []
    for module, name in _qtk_imports(path):
        try:
            mod = importlib.import_module(module)
        except ImportError as e:
            missing.append(f"{module}: {e}")
            continue
        if name is not None and not hasattr(mod, name):
            try:
                importlib.import_module(f"{module}.{name}")
            except ImportError:
                missing.append(f"{module}.{name}")
    assert not missing, f"{path.name} imports names qtk no longer has: {missing}"
