"""Conformance with NVIDIA ModelOpt: qtk's TensorRT-LLM and hf-modelopt checkpoints of the reference model have
ModelOpt's config keys and values and its tensor names, dtypes and shapes, per rank.

The reference (tests/trtllm/data/modelopt_reference.json) was written by make_modelopt_reference.py with the
real tool; the live test regenerates it when ModelOpt can be run (importable here, or QTK_MODELOPT_PYTHON
names an interpreter that has it, e.g. .venv-modelopt/bin/python)."""

import copy
import importlib.util
import json
import os
import subprocess
import sys

import pytest
from trtllm_helpers import CASES, HERE, MODEL, REFERENCE, compare, qtk_summaries

REF = json.loads(REFERENCE.read_text())


@pytest.fixture(scope="module")
def ours(calib_file, tmp_path_factory):
    return qtk_summaries(tmp_path_factory.mktemp("conf"), calib_file)


def test_reference_covers_the_cases():
    assert REF["model"] == MODEL and set(REF["cases"]) == set(CASES)
    algos = {c["config"]["quantization"]["quant_algo"] for k, c in REF["cases"].items() if k.startswith("trtllm/")}
    assert {"FP8", "W4A16_AWQ", "W8A8_SQ_PER_CHANNEL"} <= algos
    assert REF["cases"]["trtllm/fp8-kv8/tp2"]["config"]["mapping"]["tp_size"] == 2


@pytest.mark.parametrize("case", sorted(CASES))
def test_qtk_matches_modelopt(case, ours):
    diffs = compare(case, REF["cases"][case], ours[case])
    assert not diffs, f"{case} differs from ModelOpt {REF['versions']['modelopt']}:\n" + "\n".join(diffs)


def test_compare_catches_layout_differences(ours):
    """The comparison itself: a dropped tensor, a wrong dtype or shape, a wrong config value all show up."""
    case = "trtllm/w4a16-awq/tp2"
    bad = copy.deepcopy(ours[case])
    r1 = bad["ranks"]["rank1"]
    r1.pop("transformer.layers.0.mlp.fc.prequant_scaling_factor")
    r1["transformer.layers.1.attention.qkv.weight"] = ["I8", [256, 256]]  # unsplit
    r1["transformer.layers.0.mlp.proj.weights_scaling_factor"][0] = "BF16"
    bad["config"]["quantization"]["group_size"] = 64
    diffs = compare(case, REF["cases"][case], bad)
    assert len(diffs) == 4, diffs


def modelopt_python() -> str | None:
    env = os.environ.get("QTK_MODELOPT_PYTHON")
    if env:
        return env
    return sys.executable if importlib.util.find_spec("modelopt") is not None else None


@pytest.mark.skipif(modelopt_python() is None,
                    reason="nvidia-modelopt is not importable (install it in its own venv and set QTK_MODELOPT_PYTHON)")
def test_live_modelopt_matches_qtk_and_the_committed_reference(ours, tmp_path):
    out = tmp_path / "ref.json"
    subprocess.run([modelopt_python(), str(HERE / "make_modelopt_reference.py"), "--out", str(out)], check=True,
                   capture_output=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    live = json.loads(out.read_text())
    for case in CASES:
        diffs = compare(case, live["cases"][case], ours[case])
        assert not diffs, f"{case} differs from ModelOpt {live['versions']['modelopt']}:\n" + "\n".join(diffs)
    if live["versions"]["modelopt"] == REF["versions"]["modelopt"]:  # same tool: same layout as committed
        for case in CASES:
            assert not compare(case, REF["cases"][case], live["cases"][case]), case
