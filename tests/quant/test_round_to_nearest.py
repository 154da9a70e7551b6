"""Round-to-nearest (QTensor.quantize, what the rtn step runs): the QTensor convention itself, with the model dtype defaulting to the weight's."""

import torch

from qtk.quant.qtensor import QTensor
from qtk.recipe import QuantScheme


def test_rtn_rounds_to_nearest_with_dtype_rounded_scales():
    W = torch.tensor([[0.7, -0.35, 0.1, 0.0], [1.0, 0.5, -0.25, 0.3]])
    qt = QTensor.quantize(W, QuantScheme(4, strategy="channel"), torch.bfloat16)
    # the full int4 grid: scale = amax / 7.5, rounded to the model dtype before the values are taken
    torch.testing.assert_close(qt.scale, torch.tensor([[0.7 / 7.5], [1 / 7.5]]).to(torch.bfloat16).float(), rtol=0, atol=0)
    # bf16(0.7/7.5) = 0.09326171875: 0.7 -> 7.506 clamps to 7, -0.35 -> -3.753 rounds to -4
    assert qt.values.tolist() == [[7, -4, 1, 0], [7, 4, -2, 2]] and qt.dtype == torch.bfloat16
    assert qt.zero_point is None and qt.g_idx is None
    # the negative end of the grid is used: -1.875 is exactly -7.5 steps of 0.25, which rounds (half to even) to -8
    neg = QTensor.quantize(torch.tensor([[-1.875, 0.5, 0.25, 0.0]]), QuantScheme(4, strategy="channel"), torch.float32)
    assert neg.scale.item() == 0.25 and neg.values.tolist() == [[-8, 2, 1, 0]]


def test_rtn_default_dtype_is_the_weights():
    W = torch.randn(4, 64, dtype=torch.float16)
    qt = QTensor.quantize(W, QuantScheme(4, strategy="group", group_size=32, symmetric=False))
    assert qt.dtype == torch.float16 and qt.scale.shape == (4, 2)
    assert (qt.dequantize() - W.float()).abs().max() <= qt.scale.max() * 0.5 + 1e-6
