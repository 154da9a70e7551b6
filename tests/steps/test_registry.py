"""The step registry: every recipe step has an implementation with its declared phase, a recipe's plan runs its steps
in phase order with the steps it implies, step lists are validated against the phases, and a new step is one
declaration plus one registered function — the loop runs it without naming it."""

from dataclasses import dataclass

import pytest

from qtk.errors import UsageError
from qtk.recipe import load_recipe, parse_recipe
from qtk.recipe.params import STEP_PARAMS, Phase, declare_step
from qtk.steps import STEPS, plan_steps, register_step, unregister_step
from qtk.steps.records import RECORDS, StepRecord, register_record

W8 = {"num_bits": 8, "type": "int", "strategy": "channel"}


def test_every_recipe_step_has_an_implementation_with_its_declared_phase():
    for name, params in STEP_PARAMS.items():
        step = STEPS[name]
        assert (step.phase, step.needs_data, step.params, step.conflicts) == \
            (params.phase, params.needs_data, params, params.conflicts), name
    assert STEPS["input_amax"].params is None and STEPS["input_amax"].phase is Phase.OBSERVE  # implied, never listed


@pytest.mark.parametrize("recipe,plan", [
    ("w4a16", ["rtn"]), ("w4a16-gptq", ["gptq"]), ("w4a16-awq", ["awq", "rtn"]), ("w8a8-sq", ["smoothquant", "rtn"]),
    ("fp8", ["input_amax", "rtn"]), ("int8-kv8", ["smoothquant", "gptq"]), ("fp8-dynamic", ["rtn"]),
    ("nvfp4-autoround", ["awq", "input_amax", "autoround"]),
])
def test_each_built_in_recipe_plans_its_steps_in_phase_order(recipe, plan):
    assert [s.name for s, _ in plan_steps(load_recipe(recipe))] == plan


def test_static_activations_are_observed_after_smoothing_and_before_solving():
    r = parse_recipe({"name": "x", "weights": W8, "activations": {"num_bits": 8, "type": "int", "strategy": "tensor"},
                      "algorithm": [{"smoothquant": {"alpha": 0.5}}, "gptq"]})
    plan = plan_steps(r)
    assert [(s.name, s.phase) for s, _ in plan] == [("smoothquant", Phase.TRANSFORM), ("input_amax", Phase.OBSERVE),
                                                    ("gptq", Phase.SOLVE)]
    assert plan[0][1].alpha == 0.5  # the listed step keeps its parameters


@pytest.mark.parametrize("solver", ["gptq", "autoround"])
def test_awq_before_a_solver_transforms_and_the_solver_rounds(solver):
    """[awq, gptq] and [awq, autoround]: AWQ's scales and clips are a transform, the listed solver rounds (no
    round-to-nearest implied); [awq] alone still rounds to nearest."""
    w4 = {"num_bits": 4, "strategy": "group", "group_size": 32}
    plan = plan_steps(parse_recipe({"name": "x", "weights": w4, "algorithm": ["awq", solver]}))
    assert [(s.name, s.phase) for s, _ in plan] == [("awq", Phase.TRANSFORM), (solver, Phase.SOLVE)]
    assert [s.name for s, _ in plan_steps(parse_recipe({"name": "x", "weights": w4, "algorithm": ["awq"]}))] == \
        ["awq", "rtn"]


@pytest.mark.parametrize("steps,problem", [
    (["smoothquant"], "must end with exactly one of rtn, gptq, awq, autoround (got ['smoothquant'])"),
    (["gptq", "rtn"], "must end with exactly one of rtn, gptq, awq"),
    (["awq", "rtn", "gptq"], "must end with exactly one of rtn, gptq, awq"),
    (["gptq", "awq"], "must end with exactly one of rtn, gptq, awq"),
    (["smoothquant", "awq"], "awq and smoothquant both rescale the same channels"),
    (["gptq", "gptq"], "lists a step twice"),
])
def test_step_lists_are_refused_as_before(steps, problem):
    with pytest.raises(UsageError, match=problem.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(").replace(")", r"\)")):
        parse_recipe({"name": "x", "weights": W8, "algorithm": steps})


@dataclass
class _CountRecord(StepRecord):
    name = "count_inputs"
    tokens: int = 0

    def to_json(self):
        return {"tokens": self.tokens}

    @classmethod
    def from_json(cls, data):
        return cls(data["tokens"])


@pytest.fixture
def count_step():
    """A new OBSERVE step: declared with its parameters, implemented as one registered function."""
    @declare_step("count_inputs", phase=Phase.OBSERVE)
    @dataclass(frozen=True)
    class CountParams:
        scale: float = 1.0
        needs_data = True

        def validate(self, where):
            pass

    register_record(_CountRecord)
    seen = []

    @register_step("count_inputs")
    def run(ctx, params):
        seen.append((ctx.index, set(ctx.master), dict(ctx.qweights)))
        return _CountRecord(int(params.scale * sum(h.shape[0] * h.shape[1] for h, _ in ctx.batches)))

    yield seen
    unregister_step("count_inputs")
    del STEP_PARAMS["count_inputs"], RECORDS["count_inputs"]


def test_a_step_listed_out_of_phase_order_is_refused(count_step):
    with pytest.raises(UsageError, match=r"lists smoothquant \(transform\) after count_inputs \(observe\).*"
                                         r"list smoothquant before count_inputs"):
        parse_recipe({"name": "x", "weights": W8, "algorithm": ["count_inputs", "smoothquant", "gptq"]})
    assert parse_recipe({"name": "x", "weights": W8, "algorithm": ["smoothquant", "count_inputs", "gptq"]})


def test_a_new_step_runs_in_its_phase_without_the_loop_naming_it(count_step, tiny_llama, calib_file):
    from qtk.calib import calibration_ids, load_texts
    from qtk.model.source import ModelSource
    from qtk.pipeline import run

    src = ModelSource(tiny_llama)
    r = parse_recipe({"name": "x", "weights": W8, "algorithm": ["smoothquant", {"count_inputs": {"scale": 2.0}}, "gptq"]})
    ids = calibration_ids(src.tokenizer(), load_texts(str(calib_file)), 4, 16, 0)
    results = []

    class Sink:
        def add_dense(self, name, t):
            pass

        def add_layer(self, result):
            results.append(result)

    stats = run(src, r, ids, [Sink()], batch_size=2)
    # it ran after the transform (master weights exist) and before the solver (no QTensor yet), once per layer
    assert [(i, bool(m), q) for i, m, q in count_step] == [(0, True, {}), (1, True, {})]
    assert [res.records["count_inputs"] for res in results] == [_CountRecord(2 * 4 * 16)] * 2
    assert stats.records[0]["count_inputs"] == {"tokens": 128}  # the manifest's form


def test_a_recipe_step_without_an_implementation_cannot_run():
    @declare_step("unimplemented", phase=Phase.TRANSFORM)
    @dataclass(frozen=True)
    class P:
        needs_data = False

        def validate(self, where):
            pass

    try:
        r = parse_recipe({"name": "x", "weights": W8, "algorithm": ["unimplemented", "rtn"]})
        with pytest.raises(ValueError, match="no implementation registered for step.s. unimplemented"):
            plan_steps(r)
    finally:
        del STEP_PARAMS["unimplemented"]


def test_solvers_need_data_and_say_so(tiny_llama):
    from qtk.model.source import ModelSource
    from qtk.pipeline import run

    with pytest.raises(UsageError, match="GPTQ needs calibration data.*remove the gptq step or give --calib"):
        run(ModelSource(tiny_llama), load_recipe("w4a16-gptq"), None, [])


def test_registering_a_step_twice_is_refused():
    with pytest.raises(ValueError, match="already registered"):
        register_step("gptq")(lambda ctx, params: None)


@dataclass
class _PermutationRecord(StepRecord):
    """The order a step put each MLP's intermediate channels in: a change of the weights' frame."""

    name = "permute_mlp"
    perm: list = None

    def to_json(self):
        return {"perm": self.perm}

    @classmethod
    def from_json(cls, data):
        return cls(data["perm"])

    def reframe(self, W, rel, arch):
        if rel in ("mlp.gate_proj", "mlp.up_proj"):
            return W[self.perm]
        return W[:, self.perm] if rel == "mlp.down_proj" else W


@pytest.fixture
def permute_step():
    """A TRANSFORM that changes the frame the weights are quantized in (as a rotation does): it permutes each MLP's
    intermediate channels, which leaves the layer's function as it was and every weight of the MLP in a new order."""
    import torch

    @declare_step("permute_mlp", phase=Phase.TRANSFORM)
    @dataclass(frozen=True)
    class PermuteParams:
        seed: int = 0
        needs_data = True
        changes_frame = True

        def validate(self, where):
            pass

    register_record(_PermutationRecord)

    @register_step("permute_mlp")
    def run(ctx, params):
        inter = ctx.weight("mlp.up_proj").shape[0]
        perm = torch.randperm(inter, generator=torch.Generator().manual_seed(params.seed + ctx.index))
        with torch.no_grad():
            for n in ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
                w = ctx.master[n][perm] if n != "mlp.down_proj" else ctx.master[n][:, perm]
                ctx.master[n] = w
                ctx.layer.get_submodule(n).weight.copy_(w)
        return _PermutationRecord(perm.tolist())

    yield
    unregister_step("permute_mlp")
    del STEP_PARAMS["permute_mlp"], RECORDS["permute_mlp"]


def test_a_step_that_changes_the_frame_plugs_in_without_the_loop_or_the_checks_naming_it(permute_step, tiny_llama,
                                                                                       calib_file, tmp_path):
    """The loop measures each weight's error against the source put through the step's record, and the self-check
    and `qtk inspect` rebuild that frame from the manifest: the conversion passes, with the small errors of int8
    against the permuted weights (the unpermuted source would be a relative error of about 1.4)."""
    import yaml

    from qtk import api

    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"name": "permuted", "weights": W8, "algorithm": [{"permute_mlp": {"seed": 3}}, "rtn"]}))
    res = api.convert(tiny_llama, str(recipe), tmp_path / "out", calib=str(calib_file), num_samples=4, seq_len=16,
                      hash_source=False)
    recorded = res.manifest["stats"]["weight_error"]  # what the loop measured
    rep = api.inspect(res.outputs["vllm"], source=tiny_llama)
    assert rep.ok, [c for c in rep.checks if not c.ok]
    mlp = {m: e for m, e in rep.errors.items() if ".mlp." in m}
    assert len(mlp) == 6 and max(mlp.values()) < 0.05, mlp
    assert all(abs(recorded[m] - e) < 1e-3 for m, e in mlp.items())
    perms = [layer["permute_mlp"]["perm"] for layer in res.manifest["stats"]["algorithm"].values()]
    assert len(perms) == 2 and all(p != sorted(p) for p in perms)  # the frame did change
