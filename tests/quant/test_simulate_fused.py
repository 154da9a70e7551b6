"""The simulated engine runs Linears that share an input as one GEMM on one quantized input (as vLLM and
TensorRT-LLM do); the result must equal running each Linear on its own."""

import pytest
import torch

from qtk.model.simulate import FusedGEMM, QLinear, fuse_groups
from qtk.recipe import QuantScheme

INT8_TOKEN = QuantScheme(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)
FP8_STATIC = QuantScheme(num_bits=8, type="float", symmetric=True, strategy="tensor", dynamic=False)


def _members(act, scale, bias, outs=(48, 16, 16), inp=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [QLinear(torch.randn(o, inp, generator=g), torch.randn(o, generator=g) if bias else None, act,
                    None if scale is None else torch.tensor([scale])) for o in outs]


@pytest.mark.parametrize("act,scale", [(None, None), (INT8_TOKEN, None), (FP8_STATIC, 0.01)])
@pytest.mark.parametrize("bias", [False, True])
def test_fused_equals_separate(act, scale, bias):
    x = torch.randn(3, 7, 32) * 4
    sep = _members(act, scale, bias)
    fused = _members(act, scale, bias)
    FusedGEMM(fused)
    want = [m(x) for m in sep]
    got = [m(x) for m in fused]
    for w, y in zip(want, got):
        assert y.is_contiguous() and torch.equal(w, y)
    # the members' weights are views into the fused weight: one copy in memory
    assert fused[1].weight.data_ptr() == fused[0]._fused[0].weight[48].data_ptr()


def test_new_input_recomputes():
    """A different tensor (or the same one modified in place) is not served from the last call."""
    sep, fused = _members(INT8_TOKEN, None, False), _members(INT8_TOKEN, None, False)
    FusedGEMM(fused)
    x1, x2 = torch.randn(2, 5, 32), torch.randn(2, 5, 32)
    assert torch.equal(fused[0](x1), sep[0](x1))
    assert torch.equal(fused[1](x2), sep[1](x2))  # sibling called with another tensor
    x3 = torch.randn(2, 5, 32)
    fused[0](x3)
    x3.mul_(2)  # in place: the version counter changes
    assert torch.equal(fused[2](x3), sep[2](x3))


def test_only_compatible_members_fuse():
    a = _members(FP8_STATIC, 0.01, False)
    b = _members(FP8_STATIC, 0.01, False)
    b[2].input_scale = torch.tensor([0.02])  # a checkpoint with per-module static scales
    assert FusedGEMM.can_fuse(a) and not FusedGEMM.can_fuse(b)
    root = torch.nn.Module()
    root.attn = torch.nn.Module()
    for name, m in zip(("q", "k", "v"), b):
        setattr(root.attn, name, m)
    assert fuse_groups(root, ["attn.q", "attn.k", "attn.v"], [("q", "k", "v")]) == 0
    assert all(m._fused is None for m in b)
