"""What `qtk convert` writes stays byte-identical unless it is meant to change (tests/fingerprints.py).

Every built-in recipe on fixed models, with every target that accepts it: each written tensor's dtype, shape and
bytes, and each config's quantization section, against tests/data/fingerprints.json. Recipes without calibration
are elementwise arithmetic and must match on any machine; calibrated ones depend on the summation order of the
CPU's GEMM kernels, so their bytes are compared where the machine signature (torch version, CPU capability,
CPU model) is the
one the fingerprints were taken on, and their names, dtypes, shapes and configs everywhere.
"""

from __future__ import annotations

import json

import pytest

from fingerprints import DATA, MODELS, build_model, cases, machine, run_case

STORED = json.loads(DATA.read_text())
CASES = cases(None, STORED["cases"])


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("fingerprint-models")
    return {n: build_model(n, root) for n in MODELS}


def _calibrated(recipe: str) -> bool:
    from qtk.recipe import load_recipe

    return load_recipe(recipe).needs_calibration


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_fingerprint(case, models, tmp_path):
    assert case["id"] in STORED["cases"], f"no stored fingerprint for {case['id']}: run tests/fingerprints.py --update"
    want = STORED["cases"][case["id"]]
    got = run_case(case, models, tmp_path)
    same_machine = machine() == want.get("machine", STORED["machine"])  # a case added later records its own
    exact = same_machine or not _calibrated(case["recipe"])
    for t, w in want["outputs"].items():
        g = got["outputs"][t]
        assert g["configs"] == w["configs"], f"{t}: quantization config changed"
        assert g["tensors"].keys() == w["tensors"].keys(), f"{t}: different files"
        for f, names in w["tensors"].items():
            assert sorted(g["tensors"][f]) == sorted(names), f"{t}/{f}: tensor names changed"
            for n, (dtype, shape, digest) in names.items():
                gd, gs, gh = g["tensors"][f][n]
                assert (gd, gs) == (dtype, shape), f"{t}/{f}: {n} is {gd} {gs}, was {dtype} {shape}"
                if exact:
                    assert gh == digest, f"{t}/{f}: bytes of {n} changed"
