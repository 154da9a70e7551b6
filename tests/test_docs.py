"""docs/architecture.md and docs/formats.md stay true to the code: every path they name exists, every module
and target is covered, nothing cites design notes outside the repository, and every tensor a writer puts on
disk for a quantized Linear is in formats.md's tables."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from qtk.cli import main
from qtk.export import TARGETS

ROOT = Path(__file__).resolve().parent.parent
ARCH = (ROOT / "docs" / "architecture.md").read_text()
FORMATS = (ROOT / "docs" / "formats.md").read_text()


def test_no_reference_to_design_notes_outside_the_repository():
    stale = []
    for p in [*ROOT.glob("qtk/**/*.py"), *ROOT.glob("tests/**/*.py"), *ROOT.glob("benchmarks/*.py"),
              *ROOT.glob("scripts/*.py"), *ROOT.glob("*.md"), *ROOT.glob("docs/*.md")]:
        if p == Path(__file__):
            continue
        for n, line in enumerate(p.read_text().splitlines(), 1):
            if re.search(r"\b(DESIGN|FORMATS)\.md\b|shared/", line):
                stale.append(f"{p.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not stale, "cite docs/architecture.md or docs/formats.md instead:\n" + "\n".join(stale)


@pytest.mark.parametrize("doc", ["architecture.md", "formats.md"])
def test_every_path_named_exists(doc):
    text = (ROOT / "docs" / doc).read_text()
    paths = set(re.findall(r"`((?:qtk|tests|docs|benchmarks|examples)/[\w./-]*)", text))
    assert paths
    missing = [p for p in sorted(paths) if not (ROOT / p.split(":")[0]).exists()]
    assert not missing, missing


def test_architecture_names_every_module():
    named = set(re.findall(r"`(qtk/[\w/]+(?:\.py)?/?)", ARCH))
    missing = []
    for p in sorted(ROOT.glob("qtk/**/*.py")):
        rel = p.relative_to(ROOT).as_posix()
        if p.name == "__init__.py" and p.parent.name != "export":
            continue
        if rel not in named and f"{p.parent.relative_to(ROOT).as_posix()}/" not in named:
            missing.append(rel)
    assert not missing, f"docs/architecture.md does not say where these live: {missing}"


def test_formats_has_a_section_per_target():
    for t in TARGETS:
        assert f"## `{t}`" in FORMATS, t


def _quantized_tensor_suffixes(d: Path) -> set[str]:
    from qtk.export import open_checkpoint

    ck = open_checkpoint(d)
    mods = ck.modules()
    names = ck.tensor_names()
    return {n[len(m) + 1:] for n in names for m in mods if n.startswith(m + ".")}


@pytest.mark.parametrize("recipe,targets", [("w4a16", ("vllm", "gptq", "awq")), ("fp8", ("vllm", "hf-modelopt")),
                                            ("int8-kv8", ("vllm",))])
def test_every_tensor_written_is_documented(tmp_path, tiny_llama, calib_file, recipe, targets):
    args = ["convert", str(tiny_llama), "--recipe", recipe, "-o", str(tmp_path / "o"), "--calib", str(calib_file),
            "--num-samples", "4", "--seq-len", "32", "--no-hash"]
    for t in targets:
        args += ["--target", t]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    for t in targets:
        for suffix in _quantized_tensor_suffixes(tmp_path / "o" / t):
            assert f"`X.{suffix}`" in FORMATS or f"`{suffix}`" in FORMATS, (t, suffix)
    if recipe == "int8-kv8":
        assert "self_attn.k_scale" in FORMATS and ".v_scale" in FORMATS


def test_eval_table_is_rendered_from_its_records():
    """docs/eval.md's per-recipe table is what scripts/eval_table.py renders from docs/eval-table.json, so a partial
    re-run (--recipes ...) cannot leave rows that no measurement backs."""
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("eval_table", ROOT / "scripts" / "eval_table.py")
    et = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(et)
    doc = (ROOT / "docs" / "eval.md").read_text()
    table = re.search(re.escape(et.START) + r"\n\n(.*?)\n\nGenerated", doc, re.S).group(1)
    assert table == et.render(json.loads((ROOT / "docs" / "eval-table.json").read_text()))
