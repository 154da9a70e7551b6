"""Shared helpers for the planner tests: public config.json files (tests/plan/configs) and meta models."""

import json
from pathlib import Path

import pytest

CONFIGS = Path(__file__).parent / "configs"


def config(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text())


@pytest.fixture
def shape_of():
    from qtk.plan.memory import ModelShape

    return lambda name: ModelShape.from_config(config(name))


@pytest.fixture
def config_of():
    return config


def meta_model(name: str, dtype=None):
    """The transformers model built from a fixture config on the meta device (no memory, no weights)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    cfg = AutoConfig.from_pretrained(str(CONFIGS / f"{name}.json"))
    cls = AutoModelForImageTextToText if "vision_config" in config(name) else AutoModelForCausalLM
    with torch.device("meta"):
        return cls.from_config(cfg, dtype=dtype or torch.bfloat16)


@pytest.fixture
def meta_model_of():
    return meta_model
