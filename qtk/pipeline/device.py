"""Where and in what dtype the layer loop computes: the device a run's layers, activations and statistics live on
(`--device auto|cpu|cuda|cuda:N`), the dtype of the calibration forwards, and where calibration activations are kept
when they do not all fit on the device (spilled to pinned host memory, brought back batch by batch).

Precision: the forwards run in the model's dtype (bf16 on most checkpoints, what the engine computes); Hessians,
channel statistics and the GPTQ/AWQ/SmoothQuant solvers accumulate in fp32 on every device, and TF32 matmuls are
left off (torch's default) because GPTQ's Cholesky of H amplifies the ~1e-3 relative error of TF32 inputs."""

from __future__ import annotations

import os

import torch

from qtk.errors import UsageError

DEVICE_FIX = "use --device cpu, or run where `python -c 'import torch; print(torch.cuda.is_available())'` prints True"


def local_rank() -> int:
    """This process's index on its node under torchrun (0 otherwise): the GPU it uses when none is named."""
    return int(os.environ.get("LOCAL_RANK", "0") or 0)


def parse_device(spec: str | torch.device | None) -> torch.device:
    """The device `--device` names, checked before any work: auto (the first GPU visible to this process, or its
    LOCAL_RANK's under torchrun; else the CPU), cpu, cuda (the same GPU as auto), cuda:N. A GPU asked for and not
    visible is refused with the fix."""
    if spec is None:
        return torch.device("cpu")
    if isinstance(spec, torch.device):
        spec = str(spec)
    text = spec.strip().lower()
    if text == "auto":
        return torch.device("cuda", local_rank() % torch.cuda.device_count()) if torch.cuda.is_available() else torch.device("cpu")
    if text == "cpu":
        return torch.device("cpu")
    kind, _, index = text.partition(":")
    if kind != "cuda" or (index and not index.isdigit()):
        raise UsageError(f"--device {spec!r} is not a device", "use auto, cpu, cuda or cuda:N (e.g. cuda:0)")
    if not torch.cuda.is_available():
        why = "no GPU is visible to this process" if torch.version.cuda else "this torch is a CPU-only build"
        raise UsageError(f"--device {spec} asks for a GPU but torch sees none ({why})", DEVICE_FIX)
    n = torch.cuda.device_count()
    i = int(index) if index else local_rank() % n
    if i >= n:
        raise UsageError(f"--device {spec}: only {n} GPU(s) are visible (cuda:0..cuda:{n - 1})",
                         "name a visible GPU, or check CUDA_VISIBLE_DEVICES")
    return torch.device("cuda", i)


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The device of a run: the one given, else the CPU."""
    return torch.device("cpu") if device is None else torch.device(device)


def compute_dtype(source) -> torch.dtype:
    """The dtype calibration forwards run in: the model's (bf16 matmuls are several times faster than fp32 on
    CPUs, and it is what the engine runs), except float16, whose range real activations can overflow."""
    return torch.float32 if source.dtype == torch.float16 else source.dtype


def free_device_memory(device: torch.device) -> int | None:
    """Bytes free on an accelerator (None on the CPU: host memory is not budgeted here)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return None


def activation_budget(device: torch.device, layer_bytes: int, cap: int | None) -> int | None:
    """Bytes of calibration activations kept on the device for the next layer: free memory minus the working set of
    a layer (its weights loaded next, fp32 masters, Hessians and solver buffers: about four times its weights),
    capped by --max-device-memory. None: no limit (the CPU without a cap)."""
    free = free_device_memory(device)
    if free is None:
        return cap
    budget = max(0, free - 4 * layer_bytes)
    return budget if cap is None else min(budget, cap)


class Activations:
    """The calibration batches entering a layer, [(hidden states, kwargs)] as the steps iterate them: the first ones
    on the device, the rest (beyond `budget` bytes) in host memory (pinned when the device is a GPU, so the copies
    back overlap), each brought to the device only while it is used."""

    def __init__(self, batches: list, device: torch.device, budget: int | None = None):
        self.device = device
        self.items: list = []
        self.on_host: set[int] = set()  # batches kept on the host
        used = 0
        for j, (h, kw) in enumerate(batches):
            used += h.numel() * h.element_size()
            if budget is not None and used > budget:
                h = h if h.device.type == "cpu" and device.type != "cpu" else _to_host(h, device)
                self.on_host.add(j)
            else:
                h = h.to(device)
            self.items.append((h, kw))

    @property
    def spilled(self) -> int:
        return len(self.on_host)

    def keep(self, j: int, y: torch.Tensor) -> torch.Tensor:
        """y (a layer's output for batch j) kept where batch j is: its successor's inputs take no more device memory."""
        return _to_host(y, self.device) if j in self.on_host else y

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, j):
        h, kw = self.items[j]
        return h.to(self.device, non_blocking=True), kw

    def __iter__(self):
        for j in range(len(self.items)):
            yield self[j]

    def hidden(self) -> list[torch.Tensor]:
        """The hidden states where they are kept (resume state reads them; nothing is copied to the device)."""
        return [h for h, _ in self.items]


def _to_host(h: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return h.clone()  # the spill path on the CPU (tests): a host copy, as a GPU run makes
    out = torch.empty(h.shape, dtype=h.dtype, pin_memory=True)
    out.copy_(h, non_blocking=False)
    return out
