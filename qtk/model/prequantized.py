"""Sources that are already quantized, read as the 16-bit model they stand for.

One kind is read: FP8 e4m3 weights in blocks (Hugging Face `quantization_config: {quant_method: fp8,
weight_block_size: [bn, bk]}`, as DeepSeek-V3/R1, Kimi-K2 and the Qwen3 "FP8" releases ship). Each quantized Linear
stores `X.weight` (float8_e4m3fn, [out, in]) and `X.weight_scale_inv` (float32, [ceil(out/bn), ceil(in/bk)]): despite
its name the scale multiplies, w = q * s blockwise, the last block row and column partial where 128 does not divide
(vLLM's loader and DeepSeek's own weight_dequant read it so). Every other tensor is stored in 16 bits as usual.

`ModelSource` asks `FP8Blocks` for each tensor as the layer loop or the stream reads it: a quantized weight comes back
dequantized to the model dtype, one tensor at a time, so the whole model never exists in 16 bits. The arithmetic is
transformers' `Fp8Dequantize` (float32 product, one rounding to the model dtype), with partial edge blocks, which its
grid-derived block size does not cover.

Everything is checked from the headers before any work: a quantized weight with no scale, a scale with no weight,
a scale grid that is not the blocks' (a damaged or mislabelled source), a weight in another dtype than e4m3."""

from __future__ import annotations

from qtk.errors import UsageError
from qtk.quant.lazy import torch

SCALE_SUFFIX = "_scale_inv"  # X.weight -> X.weight_scale_inv
INPUT_SCALE = ".input_scale"  # activation_scheme static: each quantized Linear's input scale, not needed to dequantize
SCALE_DTYPES = ("float32", "bfloat16")
FIX_DAMAGED = "the FP8 checkpoint is damaged or incomplete: re-download it"


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def source_quantization(config: dict, name: str) -> "FP8Blocks | None":
    """The quantization of a source from its config.json: None for a 16-bit model, FP8Blocks for an FP8-block source;
    any other quantized source is refused (one line, before any work)."""
    qc = config.get("quantization_config")
    if qc is None:
        return None
    method = qc.get("quant_method", "?") if isinstance(qc, dict) else "?"
    if method != "fp8":
        why = {"compressed-tensors": "its formats are decoded only as qtk's own checkpoints, not as a source"}.get(
            str(method), "qtk dequantizes only FP8-block sources (quant_method fp8 with weight_block_size)")
        raise UsageError(f"{name} is already quantized (config.json has a {str(method)[:40]} quantization_config): {why}",
                         "give the original unquantized (bf16/fp16) model")
    return FP8Blocks.of(qc, name)


class FP8Blocks:
    """An FP8-block source: which weights are quantized (`scales`: weight name -> its scale's name) and their blocks."""

    method = "fp8"

    def __init__(self, block: tuple[int, int], qc: dict):
        self.block = block
        self.qc = qc
        self.scales: dict[str, str] = {}
        self.hidden: dict[str, object] = {}  # scale (and static input-scale) tensors: name -> file

    @classmethod
    def of(cls, qc: dict, name: str) -> "FP8Blocks":
        b = qc.get("weight_block_size")
        if b is None:
            raise UsageError(f"{name} is FP8 without weight_block_size (one scale per tensor), which qtk does not "
                             "dequantize", "give the original unquantized (bf16/fp16) model, or an FP8-block release")
        if not (isinstance(b, list) and len(b) == 2 and all(isinstance(x, int) and not isinstance(x, bool) and 0 < x <= 65536
                                                             for x in b)):
            raise UsageError(f"{name}'s quantization_config.weight_block_size is {str(b)[:60]}, not two positive whole "
                             "numbers", "restore the model's original config.json")
        fmt = qc.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise UsageError(f"{name}'s FP8 weights are {str(fmt)[:20]}, not e4m3 (float8_e4m3fn)",
                             "give the original unquantized (bf16/fp16) model")
        return cls((b[0], b[1]), qc)

    # ---- the headers ----

    def index(self, weight_map: dict, shape, dtype, where: str) -> dict:
        """weight_map without the scale tensors (kept in `hidden`), every quantized weight checked against its scale
        from the headers: `shape(name)`, `dtype(name)`."""
        out = {}
        for n, f in weight_map.items():
            if n.endswith(".weight" + SCALE_SUFFIX):
                self.hidden[n] = f
                self.scales[n[: -len(SCALE_SUFFIX)]] = n
            elif n.endswith(INPUT_SCALE) and f"{n[: -len(INPUT_SCALE)]}.weight{SCALE_SUFFIX}" in weight_map:
                self.hidden[n] = f
            else:
                out[n] = f
        bn, bk = self.block
        for w, s in self.scales.items():
            if w not in out:
                raise UsageError(f"{where} holds the scale {s} but no weight {w}", FIX_DAMAGED)
            wdt, sdt = dtype(w), dtype(s)
            if wdt != torch.float8_e4m3fn:
                raise UsageError(f"tensor {w} has an FP8 block scale but is stored as {str(wdt).replace('torch.', '')}, "
                                 "not float8_e4m3fn", FIX_DAMAGED)
            if str(sdt).replace("torch.", "") not in SCALE_DTYPES:
                raise UsageError(f"the scale {s} is stored as {str(sdt).replace('torch.', '')}, not float32", FIX_DAMAGED)
            ws, ss = list(shape(w)), list(shape(s))
            if len(ws) != 2:
                raise UsageError(f"tensor {w} is an FP8 weight of shape {ws}, not a Linear's [out, in]", FIX_DAMAGED)
            grid = [_ceil(ws[0], bn), _ceil(ws[1], bk)]
            if ss != grid:
                raise UsageError(f"the scale {s} has shape {ss}, but {bn}x{bk} blocks of the weight {ws} make {grid} "
                                 "(weight_block_size disagrees with the checkpoint)",
                                 "restore the model's original config.json, or re-download the checkpoint")
        for n in out:
            if n not in self.scales and dtype(n) == torch.float8_e4m3fn:
                raise UsageError(f"tensor {n} is FP8 but the checkpoint has no {n}{SCALE_SUFFIX} for it", FIX_DAMAGED)
        return out

    # ---- the values ----

    def dequantize(self, q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """q [out, in] e4m3 times its block scales s, rounded once to `dtype`; partial edge blocks take their block's
        scale."""
        from qtk.quant.e4m3 import to_float32

        bn, bk = self.block
        rows, cols = q.shape
        s = s.to(torch.float32)
        full, rem = divmod(cols, bk)
        out = torch.empty((rows, cols), dtype=dtype)
        # one block row at a time: the float32 product is a slab of bn rows, not a second weight-sized tensor
        for i, r0 in enumerate(range(0, rows, bn)):
            w = to_float32(q[r0:r0 + bn])
            if full:
                w[:, : full * bk].unflatten(1, (full, bk)).mul_(s[i, :full, None])
            if rem:
                w[:, full * bk:].mul_(s[i, full:])
            out[r0:r0 + bn] = w
        return out

    # ---- what it means for a recipe ----

    def same_format(self, scheme) -> bool:
        """True when `scheme` (a weight QuantScheme) is this source's own format: FP8 e4m3 in the same blocks."""
        return (scheme is not None and getattr(scheme, "type", None) == "float" and getattr(scheme, "num_bits", None) == 8
                and getattr(scheme, "strategy", None) == "block"
                and tuple(getattr(scheme, "block_structure", None) or ()) == self.block)

    def record(self) -> dict:
        """What the manifest says of the source's quantization."""
        return {"quant_method": self.method, "weight_block_size": list(self.block), "quantized_weights": len(self.scales),
                "read_as": "each weight dequantized to the model dtype as it is read (float32 product, one rounding)"}
