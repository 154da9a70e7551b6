"""Recipe fuzzing: random YAML documents, built from the real recipe keys plus junk, give either a valid
Recipe or one of qtk's own one-line errors, never a traceback, through parse_recipe and load_recipe."""

from __future__ import annotations

import math
import os
from dataclasses import fields

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from qtk.recipe.params import STEP_PARAMS
from qtk.errors import QtkError
from qtk.recipe import TOP_KEYS, Recipe, load_recipe, parse_recipe

STEP_FIELDS = {f.name: f.default for cls in STEP_PARAMS.values() for f in fields(cls)}
JUNK_KEYS = ["weight", "num_bit", "Name", "", "re:", "<<", 0, 8, True, None, 1.5]
WORDS = ["int", "float", "tensor", "channel", "group", "token", "minmax", "mse", "lm_head", "re:.*proj", "re:((",
         "default", "text", "x", "", *STEP_PARAMS]
N = int(os.environ.get("QTK_FUZZ_EXAMPLES", 300))  # a few seconds; raise it for a longer hunt
FUZZ = settings(max_examples=N, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])

scalars = st.one_of(
    st.none(), st.booleans(), st.sampled_from([0, 1, 2, 3, 4, 8, 16, 32, 128, -1, 2**70]), st.integers(),
    st.floats(), st.sampled_from([0.01, 0.5, 1.0, 2.0, math.nan, math.inf]), st.sampled_from(WORDS), st.text(max_size=6),
)
junk_key = st.sampled_from(JUNK_KEYS) | st.text(max_size=5)
any_key = st.sampled_from(sorted(TOP_KEYS) + sorted(STEP_FIELDS) + sorted(STEP_PARAMS)) | junk_key
anything = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(any_key, inner, max_size=4),
                        max_leaves=20)


def rarely(n: int):
    """True about once in n draws (hypothesis favours the first choice, so the rare one goes last)."""
    return st.sampled_from([False] * (n - 1) + [True])


def mostly(plausible):
    """Usually a plausible value, so validation gets past the first check; 1 in 12 anything at all."""
    plausible = plausible if isinstance(plausible, st.SearchStrategy) else st.sampled_from(plausible)
    return rarely(12).flatmap(lambda wild: anything if wild else plausible)


@st.composite
def mapping(draw, plausible: dict, usually: tuple = ()):
    """Real keys (each present or not; those in `usually` nearly always) with mostly plausible values;
    1 in 20 also a junk key."""
    d = {k: draw(mostly(v)) for k, v in plausible.items() if draw(st.booleans()) or (k in usually and not draw(rarely(8)))}
    if draw(rarely(20)):
        d[draw(junk_key)] = draw(scalars)
    return d


def _variants(default):
    if isinstance(default, bool):
        return [True, False]
    if isinstance(default, int):
        return [default, 1, 0, -1]
    return [default, 0.0, 0.5, 1.0, 2.0]


SCHEME = {"num_bits": [8, 8, 4, 2, 3, 16], "type": ["int", "float"], "symmetric": [True, False],
          "strategy": ["tensor", "channel", "group", "token"], "group_size": [32, 128, 0, -1],
          "dynamic": [True, False], "observer": ["minmax", "mse"]}
scheme = mapping(SCHEME, usually=("num_bits",))
step = st.one_of(
    st.sampled_from(sorted(STEP_PARAMS) + ["magic"]),
    st.builds(lambda name, params: {name: params}, st.sampled_from(sorted(STEP_PARAMS)),
              st.none() | mapping({k: _variants(v) for k, v in STEP_FIELDS.items()})),
)
RECIPE = {
    "name": ["fuzz"],
    "description": ["a recipe", None],
    "weights": scheme,
    "activations": st.none() | scheme,
    "kv_cache": st.none() | scheme,
    "algorithm": st.lists(step, min_size=1, max_size=3) | step,
    "ignore": st.lists(st.sampled_from(["lm_head", "re:.*down_proj", "mlp.up_proj", "re:(("]), max_size=2) | st.just("lm_head"),
    "calibration": st.none() | mapping({"dataset": ["default"], "num_samples": [1, 64, 0], "seq_len": [2, 256, 1],
                                        "seed": [0, 1], "text_field": ["text"]}),
}


@st.composite
def recipe_doc(draw):
    return draw(mapping(RECIPE, usually=("name", "weights")))


documents = st.one_of(recipe_doc(), recipe_doc(), recipe_doc(), recipe_doc(), recipe_doc(), anything)


def _valid_or_qtk_error(load):
    try:
        r = load()
    except QtkError as e:
        msg = str(e)
        assert msg and "\n" not in msg and e.exit_code == 2, msg
        return None
    assert isinstance(r, Recipe)
    for sch in (r.weights, r.activations, r.kv_cache):  # every field has its type: a null never stands in for a default
        if sch is not None:
            assert isinstance(sch.num_bits, int) and isinstance(sch.symmetric, bool) and isinstance(sch.dynamic, bool)
            assert sch.type in ("int", "float") and isinstance(sch.strategy, str) and isinstance(sch.observer, str)
            assert sch.group_size is None or (isinstance(sch.group_size, int) and sch.group_size > 0)
    c = r.calibration
    assert isinstance(c.dataset, str) and isinstance(c.text_field, str) and c.num_samples > 0 and c.seq_len >= 2
    assert r.name and all(isinstance(p, str) and p for p in r.ignore) and r.algorithm
    r.summary(), r.needs_calibration, r.hash  # a valid recipe is usable downstream
    return r


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


@FUZZ
@given(doc=documents)
@example(doc={"name": "x", "weights": {"num_bits": 8}, "calibration": {"num_samples": None}})  # was a TypeError
@example(doc={"name": "x", "weights": {"num_bits": 8, "symmetric": None}})  # was silently asymmetric
@example(doc={"name": "x", "weights": {"num_bits": None}})  # was "intNone is not supported"
@example(doc={"name": "x", "weights": {"num_bits": 8}, "ignore": ["re:a{99999999999}"]})  # re.compile OverflowError
@example(doc={"\n": None})  # a key with a newline made a two-line error
@example(doc={"name": "x", "weights": {"num_bits": 8, "strategy": "a\nb"}, "algorithm": [{"rtn": {"\n": 1}}]})
def test_random_documents_parse_or_fail_cleanly(scratch, doc):
    text = yaml.safe_dump(doc, allow_unicode=True)
    direct = _valid_or_qtk_error(lambda: parse_recipe(doc, text, "fuzz.yaml"))
    p = scratch / "fuzz.yaml"
    p.write_text(text, encoding="utf-8")
    loaded = _valid_or_qtk_error(lambda: load_recipe(p))
    if direct is not None and loaded is not None:  # the YAML round trip does not change the meaning
        assert loaded == direct


@settings(max_examples=max(1, N // 3), deadline=None, database=None)
@given(text=st.one_of(st.text(max_size=120), documents.map(lambda d: yaml.safe_dump(d)[: 60])))
def test_random_text_loads_or_fails_cleanly(scratch, text):
    p = scratch / "text.yaml"
    p.write_text(text, encoding="utf-8")
    _valid_or_qtk_error(lambda: load_recipe(p))
