"""A target that refuses a recipe suggests only targets that accept it: the suggestion is computed by asking every
writer's own check (qtk.export.check_targets), and no hand-written suggestion names a target that refuses."""

import re

import pytest

from qtk.errors import UsageError
from qtk.export import WRITERS, ExportOptions, accepting_targets, available_targets, check_targets
from qtk.model.source import ModelSource
from qtk.plan.decide import with_kv_cache
from qtk.recipe import builtin_recipes, load_recipe


@pytest.fixture(scope="module")
def source(tiny_llama):
    return ModelSource(tiny_llama)


def test_hf_modelopt_refusing_asymmetric_int4_suggests_only_targets_that_accept_it(source):
    """`--recipe w4a16-awq --target hf-modelopt` suggested "--target trtllm or --target vllm"; trtllm refuses it too."""
    r = load_recipe("w4a16-awq")
    with pytest.raises(UsageError) as e:
        check_targets(source, r, ExportOptions(), ["hf-modelopt"])
    named = re.findall(r"--target ([\w-]+)", e.value.fix)
    assert named == ["vllm", "awq", "gptq"] and "trtllm" not in e.value.fix
    for t in named:
        WRITERS[t].check(source, r, ExportOptions())  # each one accepts it
    with pytest.raises(UsageError):
        WRITERS["trtllm"].check(source, r, ExportOptions())
    # targets already requested are not suggested again
    with pytest.raises(UsageError) as e:
        check_targets(source, r, ExportOptions(), ["vllm", "hf-modelopt"])
    assert re.findall(r"--target ([\w-]+)", e.value.fix) == ["awq", "gptq"]


def _recipes():
    out = []
    for name in builtin_recipes():
        r = load_recipe(name)
        out.append(r)
        for kv in ("int", "float", None):  # every KV option too: hf-modelopt and the legacy targets refuse some
            out.append(with_kv_cache(r, kv, f"{name}+{kv}"))
    return out


@pytest.mark.parametrize("options", [ExportOptions(), ExportOptions(tp=2)], ids=["tp1", "tp2"])
def test_no_refusal_suggests_a_target_that_refuses(source, options):
    seen = 0
    for r in _recipes():
        ok = set(accepting_targets(source, r, options))
        for t in available_targets():
            try:
                check_targets(source, r, options, [t])
            except UsageError as e:
                seen += 1
                rest = e.fix[e.fix.index("--target"):] if "--target" in (e.fix or "") else ""
                named = {n for n in available_targets() if re.search(rf"(?<![\w-]){re.escape(n)}(?![\w-])", rest)} - {t}
                assert named <= ok, (r.name, t, e.fix, sorted(ok))
    assert seen > 20  # the combinations above do exercise the refusals
