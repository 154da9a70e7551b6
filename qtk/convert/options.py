"""The options of one conversion, checked once when they are built: everything `qtk convert` takes besides the model,
the recipe and OUT. Range checks come here, before any file is opened; what needs the model or the recipe (output
paths, ignore patterns, targets) is checked by the job's first step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from qtk.errors import UsageError


@dataclass(frozen=True)
class ConvertOptions:
    """calib_ids: pre-tokenized calibration samples [num_samples, seq_len] used as they are (instead of calib /
    num_samples / seq_len / seed / text_field / split). targets: deduplicated, in the order given."""

    targets: Sequence[str] = ("vllm",)
    calib: str | None = None
    calib_ids: object = field(default=None, compare=False, repr=False)
    text_field: str | None = None
    split: str | None = None
    num_samples: int | None = None
    seq_len: int | None = None
    seed: int | None = None
    overwrite: bool = False
    tp: int = 1
    pp: int = 1
    max_shard_bytes: int = 5 * 10**9
    batch_size: int = 8
    allow_pickle: bool = False
    trust_remote_code: bool = False
    hash_source: bool = True
    resume: bool = False
    device: str | None = "cpu"  # auto | cpu | cuda | cuda:N (qtk.pipeline.device.parse_device)
    max_device_memory: int | None = None  # bytes of calibration activations kept on the device; the rest spill to host
    overlap: bool = True  # read layer i+1 and write layer i in background threads while layer i computes
    verify_engine: str | None = None  # "vllm": run each output that engine loads in it, against qtk's simulation
    # further names in OUT the caller writes after the conversion (convert --gate's reports): checked with the
    # outputs before any work
    also_writes: Sequence[str] = ()

    def __post_init__(self):
        object.__setattr__(self, "targets", tuple(dict.fromkeys(self.targets or ["vllm"])))
        object.__setattr__(self, "also_writes", tuple(self.also_writes))
        if self.tp < 1 or self.pp < 1:
            raise UsageError(f"--tp and --pp must be >= 1 (got tp={self.tp}, pp={self.pp})", "use e.g. --tp 2")
        for flag, v, least, example in (("--num-samples", self.num_samples, 1, 64), ("--seq-len", self.seq_len, 2, 256),
                                        ("--batch-size", self.batch_size, 1, 8)):
            if v is not None and v < least:  # checked even when the recipe needs no calibration: a typo should not pass silently
                raise UsageError(f"{flag} must be >= {least} (got {v})", f"use e.g. {flag} {example}")
        if self.max_device_memory is not None and self.max_device_memory < 0:
            raise UsageError(f"--max-device-memory must be >= 0 (got {self.max_device_memory} bytes)", "use e.g. --max-device-memory 20GB")
        from qtk.pipeline.device import parse_device

        parse_device(self.device)  # a GPU asked for where none is visible is refused before any file is opened
        if self.verify_engine is not None:
            from qtk.eval.engine_check import ENGINE_TARGETS

            if self.verify_engine not in ENGINE_TARGETS:
                raise UsageError(f"--verify-engine {self.verify_engine}: qtk runs checkpoints in vllm only",
                                 "use --verify-engine vllm")
            if not set(self.targets) & set(ENGINE_TARGETS[self.verify_engine]):
                raise UsageError(f"--verify-engine {self.verify_engine} runs the {' or '.join(ENGINE_TARGETS[self.verify_engine])} "
                                 f"output, and no such target is written ({', '.join(self.targets)})",
                                 f"add --target {ENGINE_TARGETS[self.verify_engine][0]}")
            from qtk.eval.engines import vllm_available

            ok, why = vllm_available()
            if not ok:
                raise UsageError(f"--verify-engine vllm: {why}", "install vLLM (make engine-env) or leave --verify-engine out")
        if self.max_shard_bytes < 1:
            raise UsageError(f"--max-shard-size must be positive (got {self.max_shard_bytes} bytes)", "use e.g. --max-shard-size 5GB")

    @property
    def export(self):
        """What the writers take (qtk.export.ExportOptions)."""
        from qtk.export import ExportOptions

        return ExportOptions(max_shard_bytes=self.max_shard_bytes, tp=self.tp, pp=self.pp)

    @property
    def calibration_given(self) -> dict:
        """The calibration options set on the command line (None: the recipe's own), by name."""
        return {"calib": self.calib, "calib_ids": self.calib_ids, "text_field": self.text_field, "split": self.split,
                "num_samples": self.num_samples, "seq_len": self.seq_len, "seed": self.seed}
