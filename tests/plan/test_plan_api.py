"""qtk.api.plan: the Python entry point agrees with the planner it wraps."""

import pytest

from plan_helpers import CONFIGS
from qtk import api
from qtk.errors import CheckFailed


def test_api_plan_for_a_recipe_and_a_recommendation():
    cfg = CONFIGS / "llama-3.2-3b.json"
    p = api.plan(cfg, "int8-kv8", gpu="a100-80g", context=4096, concurrency=8)
    # 28 layers x 8 KV heads x 128 x 2 (K and V) x 1 byte (8-bit KV)
    assert p.recipe.name == "int8-kv8" and p.memory.kv_per_token_per_gpu == 28 * 8 * 128 * 2
    rec = api.plan(cfg, gpu="h100-80g", context=4096, concurrency=8, recommend=True)
    assert rec.recommendation is not None and rec.recipe is rec.recommendation.recipe
    assert rec.recipe_name == rec.recommendation.chosen


def test_api_plan_nothing_fits_is_a_failed_check():
    cfg = next(p for p in sorted(CONFIGS.glob("*.json")) if "70" in p.name)
    with pytest.raises(CheckFailed, match="nothing fits"):
        api.plan(cfg, gpu="t4", context=32768, concurrency=64, recommend=True)
