"""NVFP4: global and group scale conventions on known values, the fused global scale, and bit equality
with compressed-tensors' own observer math, quantizer and nvfp4-pack-quantized compressor."""

import pytest
import torch

from qtk.quant.fp4 import pack_fp4, unpack_fp4
from qtk.quant.formats.nvfp4 import (
    nvfp4_dequantize,
    nvfp4_fake_quant,
    nvfp4_global_scale,
    nvfp4_group_scales,
    nvfp4_quantize,
    nvfp4_weight_global_scale,
)


def test_global_scale_known_values():
    assert nvfp4_global_scale(torch.tensor(2688.0)).tolist() == [1.0]  # 448 * 6 / amax
    assert nvfp4_global_scale(torch.tensor([-1.0, 0.5])).tolist() == [2688.0]
    assert nvfp4_global_scale(torch.tensor(0.0)).tolist() == [1.0]  # nothing to scale: compressed-tensors' fallback
    gs = nvfp4_global_scale(torch.tensor(3.0))
    assert gs.dtype == torch.float32 and gs.shape == (1,)


def test_group_scale_known_values():
    w = torch.zeros(2, 32)
    # group amax 6 under gs 1 -> scale 1.0: each value rounds to its own e2m1 code (midpoints to the even code)
    w[0, :16] = torch.tensor([-6, -5.1, -4.9, -3, -2.5, -1.75, -0.75, -0.3, 0, 0.25, 0.74, 1.3, 2.6, 3.5, 5.0, 6.0])
    w[0, 16:] = 0.5  # amax 0.5 -> 0.5/6 in fp8
    scale = nvfp4_group_scales(w, torch.tensor([1.0]))
    assert scale.dtype == torch.float8_e4m3fn and scale.shape == (2, 2)
    assert scale[0, 0].item() == 1.0
    assert scale[0, 1].item() == torch.tensor(0.5 / 6).to(torch.float8_e4m3fn).item()
    assert scale[1].float().tolist() == [0.125, 0.125]  # an all-zero group: compressed-tensors' eps for fp8 scales
    q = nvfp4_quantize(w, scale, torch.tensor([1.0]))
    assert q.shape == w.shape and q.dtype == torch.uint8
    assert q[0, :16].tolist() == [15, 15, 14, 13, 12, 12, 10, 9, 0, 0, 1, 3, 5, 6, 6, 7]


def test_fused_global_scale_is_the_smallest():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(32, 64, generator=g) * s for s in (0.1, 0.3, 0.2))
    shared = nvfp4_weight_global_scale(q, k, v)
    assert torch.equal(shared, torch.min(torch.cat([nvfp4_weight_global_scale(t) for t in (q, k, v)])).reshape(1))
    assert torch.equal(shared, nvfp4_weight_global_scale(k))


def _ct(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(shape, generator=g) * torch.rand(shape[0], 1, generator=g) * 0.2).to(dtype)
    w[0, :16] = 0
    w[-1, -16:] *= 1e-4  # a group whose fp8 scale underflows under the tensor's global scale
    return w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(64, 128), (33, 48), (7, 16)])
def test_matches_compressed_tensors(shape, dtype):
    """Same global scale, group scales, codes and packed bytes as compressed-tensors' NVFP4 preset; its
    decompressor gives back qtk's dequantized weight; its activation fake-quant equals qtk's."""
    from compressed_tensors.compressors.nvfp4 import NVFP4PackedCompressor
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams, compute_dynamic_scales_and_zp, generate_gparam

    scheme = preset_name_to_scheme("NVFP4", ["Linear"])
    w = _ct(shape, dtype, seed=shape[0])
    groups = w.reshape(shape[0], -1, 16)
    gs_ct = generate_gparam(w.amin(), w.amax())
    scale_ct, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights, global_scale=gs_ct)

    gs = nvfp4_weight_global_scale(w)
    scale = nvfp4_group_scales(w, gs)
    assert torch.equal(gs, gs_ct)
    assert torch.equal(scale.float(), scale_ct.float())

    sd = NVFP4PackedCompressor.compress({"weight": w, "weight_scale": scale_ct, "weight_global_scale": gs_ct}, scheme)
    codes = nvfp4_quantize(w, scale, gs)
    assert sd["weight_packed"].dtype == torch.uint8 and sd["weight_packed"].shape == (shape[0], shape[1] // 2)
    assert torch.equal(pack_fp4(codes), sd["weight_packed"])
    assert torch.equal(sd["weight_scale"].view(torch.uint8), scale.view(torch.uint8))
    decoded = NVFP4PackedCompressor.decompress(sd, scheme)["weight"]
    assert torch.equal(decoded, nvfp4_dequantize(unpack_fp4(sd["weight_packed"]), scale, gs, decoded.dtype))

    x = (torch.randn(3, 5, shape[1], generator=torch.Generator().manual_seed(1)) * 3).to(dtype)
    igs = nvfp4_global_scale(x.abs().amax())
    act = scheme.input_activations
    s_act, _ = compute_dynamic_scales_and_zp(x, act, None, global_scale=igs)
    assert torch.equal(nvfp4_fake_quant(x, igs), fake_quantize(x, s_act, None, act, global_scale=igs))


def test_round_trip_error_is_bounded():
    w = _ct((64, 256), torch.float32, seed=3)
    gs = nvfp4_weight_global_scale(w)
    scale = nvfp4_group_scales(w, gs)
    deq = nvfp4_dequantize(nvfp4_quantize(w, scale, gs), scale, gs)
    # e2m1 spacing is at most 2 units of s/gs, and a normal fp8 scale clips amax by at most 1/16: |error| <= 1 unit.
    # (Groups whose fp8 scale is subnormal lose scale precision and are left out of the bound.)
    unit = (scale.float() / gs).repeat_interleave(16, dim=1)
    normal = (scale.float() >= 2.0**-6).repeat_interleave(16, dim=1)
    assert normal.float().mean() > 0.9
    assert ((deq - w).abs() <= unit * 1.001)[normal].all()
    assert torch.equal(nvfp4_dequantize(nvfp4_quantize(deq, scale, gs), scale, gs), deq)  # idempotent on its grid


def test_refuses_groups_that_do_not_divide():
    with pytest.raises(ValueError, match="16"):
        nvfp4_group_scales(torch.ones(4, 24), torch.tensor([1.0]))
