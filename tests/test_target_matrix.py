"""docs/families.md, the family x recipe x target matrix (scripts/target_matrix.py), is what the code says: every cell
is either refused before any work with the line the page quotes, or converted by the test it names. This file holds
the conversions tests/test_architectures.py does not do (every target but vllm, and vllm's recipes that test leaves
out), and fails when the page is stale."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from qtk import api
from qtk.recipe import builtin_recipes
from models import fewer_iterations
from test_architectures import ARCH_CONFIGS

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import target_matrix  # noqa: E402


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    models = target_matrix.build_models(tmp_path_factory.mktemp("families"))
    return models, target_matrix.matrix(models)


def test_families_md_is_current(matrix):
    """docs/families.md is what scripts/target_matrix.py renders from the checks today."""
    _, cells = matrix
    assert target_matrix.DOC.read_text() == target_matrix.render(cells), \
        "docs/families.md is stale: run python scripts/target_matrix.py and review the diff"


def test_every_family_and_target_is_in_the_matrix(matrix):
    """The page covers every family the architecture tests build, every shipped recipe and every registered target,
    and a cell it marks converted by test_architectures is one that test converts (not one it expects refused)."""
    from qtk.export import available_targets
    from test_architectures import REFUSED

    _, cells = matrix
    assert {f for f, _, _ in cells} == set(ARCH_CONFIGS)
    assert {r for _, r, _ in cells} == set(builtin_recipes())
    assert {t for _, _, t in cells} == set(available_targets())
    for (f, r, t), why in cells.items():
        if why is None and target_matrix.converting_test(f, r, t).startswith(target_matrix.ARCH_TEST):
            assert (f, r) not in REFUSED, (f, r)
        if (f, r) in REFUSED and t == "vllm":
            assert why is not None and REFUSED[f, r] in why, (f, r)


@pytest.mark.parametrize("recipe", sorted(builtin_recipes()))
@pytest.mark.parametrize("family", list(ARCH_CONFIGS))
def test_converts_to_every_accepting_target(matrix, calib_file, tmp_path, family, recipe):
    """One conversion of the family's tiny model to every target whose cell docs/families.md marks M; each output is
    inspected from its bytes."""
    models, cells = matrix
    targets = [t for (f, r, t), why in cells.items() if (f, r) == (family, recipe) and why is None
               and target_matrix.converting_test(f, r, t).startswith(target_matrix.MATRIX_TEST)]
    if not targets:
        pytest.skip("no cell of this family and recipe is left to this test (refused, or tests/test_architectures.py)")
    res = api.convert(models[family], fewer_iterations(recipe, tmp_path), tmp_path / "o", targets=targets, calib=str(calib_file), num_samples=4,
                      seq_len=48, hash_source=False)
    assert sorted(res.outputs) == sorted(targets)
    for t in targets:
        report = api.inspect(res.outputs[t])
        assert report.ok, (t, report)
