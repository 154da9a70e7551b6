"""Format.quantize_decoded (the data-free stream's fast path): a half-precision weight rounded in its own dtype
gives quantize()'s values of its float32 copy and the engine's decode of them, bit for bit."""

import pytest
import torch

from qtk.model.simulate import engine_weight
from qtk.quant.formats import format_for
from qtk.quant.qtensor import QTensor
from qtk.quant.scheme import QuantScheme

SCHEMES = {
    "int8-channel": QuantScheme(num_bits=8, type="int", symmetric=True, strategy="channel"),
    "int4-group128": QuantScheme(num_bits=4, type="int", symmetric=True, strategy="group", group_size=128),
    "int4-asym-group32": QuantScheme(num_bits=4, type="int", symmetric=False, strategy="group", group_size=32),
    "int8-asym-channel": QuantScheme(num_bits=8, type="int", symmetric=False, strategy="channel"),
    "fp8-channel": QuantScheme(num_bits=8, type="float", symmetric=True, strategy="channel"),
}


def _weight(dtype, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(48, 256, generator=g) * 0.05
    w[3] = 0.0  # an all-zero row: the eps scale
    w[5, :7] = torch.tensor([1e-8, -3.0, 2.5, 1e4 if dtype == torch.bfloat16 else 100.0, -1e-3, 0.0, 7.0])
    w[9] += 0.3  # an offset row: the asymmetric zero point at work
    return w.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_half_arithmetic_gives_the_float32_paths_bits(name, dtype):
    scheme = SCHEMES[name]
    fmt = format_for(scheme)
    from test_ct_rounding import weights  # groups on 16-level grids: quotients within half precision of a tie

    for w in [_weight(dtype, seed) for seed in range(3)] + [weights(dtype, seed) for seed in range(2)]:
        w32 = w.float()
        qp = fmt.qparams(w32, scheme, dtype)
        want = fmt.quantize(w32, qp, scheme, model_dtype=dtype)
        values, decoded = fmt.quantize_decoded(w, qp, scheme, dtype)
        assert values.dtype == want.dtype and torch.equal(values.view(torch.uint8), want.view(torch.uint8))
        engine = engine_weight(QTensor(want, qp.scale, scheme, qp.zero_point, None, dtype, {}))
        assert decoded.dtype == torch.float32 and torch.equal(decoded, engine)


def test_it_declines_what_it_cannot_reproduce():
    fmt = format_for(SCHEMES["int8-channel"])
    w = _weight(torch.bfloat16, 0)
    qp = fmt.qparams(w.float(), SCHEMES["int8-channel"], torch.bfloat16)
    assert fmt.quantize_decoded(w.float(), qp, SCHEMES["int8-channel"], torch.float32) is None  # a float32 model
    assert fmt.quantize_decoded(w.float(), qp, SCHEMES["int8-channel"], torch.bfloat16) is None  # not in its dtype
    tensor = QuantScheme(num_bits=8, type="float", symmetric=True, strategy="tensor")
    assert format_for(tensor).quantize_decoded(w, format_for(tensor).qparams(w.float(), tensor, torch.bfloat16),
                                               tensor, torch.bfloat16) is None
