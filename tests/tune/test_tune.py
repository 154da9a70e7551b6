"""qtk tune end to end on the trained example model, and its search against qtk plan's byte counts and memory model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from qtk import api
from qtk.cli import main
from qtk.errors import UsageError
from qtk.model.source import ModelSource
from qtk.pipeline import target_linears
from qtk.plan.deployment import Deployment
from qtk.plan.hardware import get_gpu
from qtk.plan.memory import ModelShape, read_config, weight_bytes
from qtk.plan.planner import make_plan
from qtk.recipe import Recipe
from qtk.tune.search import (
    Assignment,
    Budget,
    assignment,
    build_frontier,
    deployment_budget,
    load_candidates,
    parse_tuned,
    recipe_text,
    uniform_points,
    unit_costs,
)
from qtk.tune.sensitivity import Sensitivity, UnitSensitivity, units_of

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tiny-llama"
TASKS = ROOT / "examples" / "tasks.yaml"


def _layout(cset, damage=lambda i, label, c: 0.0):
    src = ModelSource(EXAMPLE)
    probe = Recipe(name="p", weights=next(c for c in cset.candidates if not c.dense).scheme.weights)
    units = []
    for i in range(src.num_layers):
        for u in units_of(src.arch, target_linears(src, probe, i)):
            units.append(UnitSensitivity(i, u.label, tuple(src.layer_prefix(i) + t for t in u.linears),
                                         {c.name: damage(i, u.label, c) for c in cset.candidates}))
    return Sensitivity(cset.candidates, units)


def _synthetic(i, label, c):  # later layers and the MLP more sensitive; fewer bits more damaging
    return 0.0 if c.dense else (1 + i) * (3 if "gate" in label or label == "down" else 1) * (50 if c.scheme.weights.num_bits == 4 else 1)


def test_unit_bytes_add_up_to_the_plans_checkpoint_bytes():
    """Every frontier point's bytes are what qtk plan counts for the recipe it is written as."""
    cset = load_candidates(["w4a16-gptq", "w8a16", "bf16"])
    sens = _layout(cset, _synthetic)
    shape = ModelShape.from_config(read_config(EXAMPLE))
    costs = unit_costs(shape, sens, cset)
    budget = Budget(10**9, "test", ())
    f = build_frontier(sens, costs, budget)
    assert len(f) > 10
    for p in f.points[:: max(1, len(f) // 12)]:
        a = assignment(p, sens, budget)
        if all(c == "bf16" for c in a.choice):
            continue
        r = parse_tuned(recipe_text(a, sens, cset, "t"), "t.yaml")
        assert weight_bytes(shape, r).total == p.bytes
        for u, c in zip(sens.units, a.choice):  # every unit's modules resolve to the chosen scheme
            for m in u.modules:
                got = r.scheme_for(m)
                assert (got is None) if c == "bf16" else (got == cset.recipes[c].default_scheme)
    uni = {n: b for n, b, _ in uniform_points(sens, costs, budget)}
    assert uni["w4a16-gptq"] == weight_bytes(shape, Recipe("x", cset.recipes["w4a16-gptq"].weights)).total
    assert uni["bf16"] == weight_bytes(shape, None).total


def test_deployment_budget_chooses_8bit_kv_when_16bit_does_not_fit():
    """A deployment whose 16-bit KV cache leaves no room: the search frees it with an 8-bit KV cache, and qtk plan
    agrees that the chosen point fits while the next larger frontier point does not."""
    cset = load_candidates(["w4a16-gptq", "w8a16", "bf16"], get_gpu("l4"))
    sens = _layout(cset, _synthetic)
    shape = ModelShape.from_config(read_config(EXAMPLE))
    costs = unit_costs(shape, sens, cset)
    # the concurrency at which an 8-bit KV cache leaves room for about 1.2 MB of weights (16-bit KV: none)
    def room(n):
        b = deployment_budget(shape, Deployment(gpu=get_gpu("l4"), context=512, concurrency=n), {"fp8": 5.0})
        return b.limit - b.kv[1].bytes - costs.base
    n = 1000
    while room(n * 2) > 0:
        n *= 2
    lo, hi = n, 2 * n  # bisect for the largest n that leaves ≥ 1.2 MB - base
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if room(mid) >= 1_200_000 - costs.base else (lo, mid - 1)
    dep = Deployment(gpu=get_gpu("l4"), context=512, concurrency=lo)
    budget = deployment_budget(shape, dep, {"fp8": 5.0})
    assert budget.kv[0].bytes + costs.base > budget.limit  # a 16-bit KV cache alone does not fit
    f = build_frontier(sens, costs, budget)
    best = f.best_within(budget.limit)
    a = assignment(best, sens, budget)
    assert a.kv.kv_type == "float" and len(set(a.choice)) > 1  # a mix, neither all 16-bit nor uniform
    r = parse_tuned(recipe_text(a, sens, cset, "t"), "t.yaml")
    assert r.kv_cache is not None
    assert make_plan(shape, r, dep).memory.fits
    nxt = f.points[f.points.index(best) + 1]
    r2 = parse_tuned(recipe_text(assignment(nxt, sens, budget), sens, cset, "t"), "t.yaml")
    assert not make_plan(shape, r2, dep).memory.fits


def test_uniform_only_frontier_is_uniform():
    cset = load_candidates(["w4a16-gptq", "w8a16", "bf16"])
    sens = _layout(cset, _synthetic)
    shape = ModelShape.from_config(read_config(EXAMPLE))
    budget = Budget(10**9, "test", ())
    f = build_frontier(sens, unit_costs(shape, sens, cset), budget, uniform_only=True)
    assert len(f) == 3
    for p in f.points:
        assert len(set(assignment(p, sens, budget, uniform_only=True).choice)) == 1


def test_candidates_refused():
    with pytest.raises(UsageError, match="quantizes activations"):
        load_candidates(["int8-kv8", "bf16"])
    with pytest.raises(UsageError, match="transforms the whole layer"):
        load_candidates(["w4a16-awq", "bf16"])
    with pytest.raises(UsageError, match="no quantized scheme"):
        load_candidates(["bf16"])


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    out = tmp_path_factory.mktemp("tune") / "out"
    res = api.tune(EXAMPLE, TASKS, out, max_weight_bytes=1_000_000, max_rounds=2, num_samples=16, seq_len=64,
                   limit=24, tasks=["prose"], threads=1)
    return out, res


def test_tune_end_to_end(tuned):
    out, res = tuned
    assert res.passed and res.outputs == {"vllm": out / "vllm"}
    rep = json.loads((out / "tune.json").read_text())
    assert rep["final"]["bytes"] <= 1_000_000
    assert len(rep["trials"]) == len(res.trials) <= 2 and rep["trials"][0]["passed"] in (True, False)
    for f in ("recipe.yaml", "tune.md", "frontier.png", "rounds/round-1/gate.json"):
        assert (out / f).is_file(), f
    assert not (out / "rounds" / "round-1" / "vllm").exists()  # round checkpoints are not kept
    ck = api.inspect(out / "vllm")
    assert ck.ok
    # the checkpoint's bytes on disk: the tensors the plan counts (its size is the frontier point's bytes)
    shape = ModelShape.from_config(read_config(EXAMPLE))
    r = parse_tuned((out / "recipe.yaml").read_text(), "recipe.yaml")
    assert weight_bytes(shape, r).total == rep["final"]["bytes"]
    assert r.mixed or any(c == "bf16" for c in rep["final"]["units"].values())


def test_tuned_recipe_reproduces_the_checkpoint_byte_for_byte(tuned, tmp_path):
    out, _ = tuned
    r = CliRunner().invoke(main, ["convert", str(EXAMPLE), "--recipe", str(out / "recipe.yaml"), "-o", str(tmp_path / "re")])
    assert r.exit_code == 0, r.output
    a, b = out / "vllm", tmp_path / "re" / "vllm"
    files = sorted(p.name for p in a.iterdir() if p.suffix in (".safetensors", ".json") and p.name != "qtk.json")
    assert "model.safetensors" in files and "config.json" in files
    for name in files:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_tune_budget_nothing_meets_names_the_smallest(tmp_path):
    r = CliRunner().invoke(main, ["tune", str(EXAMPLE), "--tasks", str(TASKS), "-o", str(tmp_path / "o"),
                                  "--max-weight-bytes", "100000"])
    assert r.exit_code == 1, r.output
    cset = load_candidates(["w4a16-gptq", "w8a16", "bf16"])
    shape = ModelShape.from_config(read_config(EXAMPLE))
    smallest = weight_bytes(shape, Recipe("x", cset.recipes["w4a16-gptq"].weights)).total
    assert f"--max-weight-bytes {smallest}" in r.output
    assert not (tmp_path / "o").exists()
