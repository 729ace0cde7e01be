"""The CPU GEMM (oneDNN) against a float64 reference: decode-sized and prefill-sized inputs, bias, strided inputs,
bfloat16; and the fallback to F.linear where oneDNN does not serve."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from surge.model.layers import gemm


@pytest.mark.parametrize("rows", [0, 1, 16, 257])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_float64_reference(rows, bias):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=g)
    w = torch.randn(200, 96, generator=g) / 10
    b = torch.randn(200, generator=g) if bias else None
    with torch.inference_mode():
        got = gemm.linear(x, w, b)
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert got.dtype == torch.float32 and got.shape == (rows, 200)
    torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-5)


def test_strided_and_batched_inputs():
    x = torch.randn(3, 5, 128)[..., ::2]  # not contiguous
    w = torch.randn(32, 64)
    with torch.inference_mode():
        got = gemm.linear(x, w)
    torch.testing.assert_close(got.double(), F.linear(x.double(), w.double()), atol=1e-5, rtol=1e-5)


def test_bfloat16():
    x, w = torch.randn(16, 64).bfloat16(), torch.randn(48, 64).bfloat16()
    with torch.inference_mode():
        got = gemm.linear(x, w)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), F.linear(x.float(), w.float()), atol=0.1, rtol=2e-2)


@pytest.mark.skipif(not gemm._ONEDNN, reason="this torch has no oneDNN")
def test_cpu_inference_uses_onednn_and_autograd_does_not():
    x, w = torch.randn(4, 8), torch.randn(6, 8)
    with torch.inference_mode():
        assert gemm.uses_onednn(x, w)
    assert not gemm.uses_onednn(x.requires_grad_(), w)  # oneDNN's op has no backward here: F.linear keeps autograd
    assert not gemm.uses_onednn(x.detach().double(), w.double())
    y = gemm.linear(x, w)
    y.sum().backward()
    torch.testing.assert_close(x.grad, w.sum(0).expand(4, 8))


@pytest.mark.skipif(not gemm._ONEDNN, reason="this torch has no oneDNN")
def test_packed_copy_follows_the_weight():
    """A layer's packed copy gives the plain weight's results, and is packed again after the weight changes: in
    place through the layer's parameter, rebound, or loaded through load_weights (which writes param.data)."""
    from surge.model.layers.linear import Linear
    from surge.model.loader.safetensors_loader import load_weights

    layer = Linear(64, 40)
    x = torch.randn(16, 64)

    def check():
        with torch.inference_mode():
            got = layer(x)
        torch.testing.assert_close(got.double(), F.linear(x.double(), layer.weight.double()), atol=1e-5, rtol=1e-5)

    with torch.no_grad():
        layer.weight.normal_()
    check()
    packed = layer._onednn_weight[1]
    check()
    assert layer._onednn_weight[1] is packed  # reused while the weight is unchanged
    with torch.no_grad():
        layer.weight.mul_(2)
    check()
    layer.weight = torch.nn.Parameter(torch.randn(40, 64), requires_grad=False)
    check()

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = layer

        def checkpoint_name_to_param(self, name):
            return name, None

    load_weights(Model(), [("proj.weight", torch.randn(40, 64))], "test")
    assert "_onednn_weight" not in layer.__dict__
    check()
    assert "_onednn_weight" not in layer.state_dict() and len(list(layer.parameters())) == 1


def test_packing_can_be_turned_off(monkeypatch):
    from surge.model.layers.linear import Linear

    monkeypatch.setenv("SURGE_CPU_PACKED_WEIGHTS", "0")
    layer = Linear(32, 8)
    with torch.no_grad():
        layer.weight.normal_()
    with torch.inference_mode():
        got = layer(torch.ones(2, 32))
    assert "_onednn_weight" not in layer.__dict__
    torch.testing.assert_close(got, layer.weight.sum(1).expand(2, 8), atol=1e-5, rtol=1e-5)
