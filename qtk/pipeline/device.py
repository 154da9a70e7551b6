"""Where and in what dtype the layer loop computes: the device a run's layers, activations and statistics live on
(the CPU unless asked; issue 13 adds accelerators), and the dtype of the calibration forwards."""

from __future__ import annotations

import torch


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The device of a run: the one given, else the CPU."""
    return torch.device("cpu") if device is None else torch.device(device)


def compute_dtype(source) -> torch.dtype:
    """The dtype calibration forwards run in: the model's (bf16 matmuls are several times faster than fp32 on
    CPUs, and it is what the engine runs), except float16, whose range real activations can overflow."""
    return torch.float32 if source.dtype == torch.float16 else source.dtype
