"""`torch`, imported the first time one of its attributes is read.

The number formats (qtk.quant.formats) are one object each, from the recipe parser's and the planner's questions
(which schemes, which tensors on disk, how many bytes) to the arithmetic. The parser and `qtk plan` import no torch
(plan works from config.json alone), so a format module names torch through this module: importing the format costs
nothing, and torch is imported when a method that computes runs. Attributes are kept once read, so later reads are
plain attribute reads."""

from __future__ import annotations

import importlib


class Deferred:
    """A module imported on the first read of one of its attributes."""

    def __init__(self, name: str):
        self.__dict__["_module_name"] = name

    def __getattr__(self, attr: str):
        value = getattr(importlib.import_module(self.__dict__["_module_name"]), attr)
        self.__dict__[attr] = value
        return value

    def __repr__(self) -> str:
        return f"<deferred module {self.__dict__['_module_name']!r}>"


torch = Deferred("torch")
