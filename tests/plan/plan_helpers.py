"""Helpers for the planner tests: public config.json files (tests/plan/configs) and meta models.

A plain module, not a conftest.py: a second conftest would shadow tests/conftest.py for
`from conftest import ...` elsewhere in the suite.
"""

import json
from pathlib import Path

CONFIGS = Path(__file__).parent / "configs"


def config(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text())


def shape(name: str):
    from qtk.plan.memory import ModelShape

    return ModelShape.from_config(config(name))


def meta_model(name: str, dtype=None):
    """The transformers model built from a fixture config on the meta device (no memory, no weights)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    cfg = AutoConfig.from_pretrained(str(CONFIGS / f"{name}.json"))
    cls = AutoModelForImageTextToText if "vision_config" in config(name) else AutoModelForCausalLM
    with torch.device("meta"):
        return cls.from_config(cfg, dtype=dtype or torch.bfloat16)
