"""The CPU GEMM (oneDNN) against a float64 reference: decode-sized and prefill-sized inputs, bias, strided inputs,
bfloat16 and float16 on each path; the policy that picks a path from the CPU's capabilities; and the fallback to
F.linear where oneDNN does not serve."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from surge.model.layers import gemm
from surge.model.layers.cpu_caps import CpuCaps, cpu_caps, native_bf16

HAS_ONEDNN = cpu_caps().onednn


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


@pytest.mark.parametrize("path", [None, gemm.ONEDNN, gemm.ONEDNN_FP32, gemm.TORCH])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(monkeypatch, dtype, path):
    """Each path (None: the one this CPU picks) through a layer that packs its weight and through a bare call."""
    from surge.model.layers.linear import Linear

    if path == gemm.ONEDNN and not (HAS_ONEDNN and dtype == torch.bfloat16 and cpu_caps().onednn_bf16):
        pytest.skip("oneDNN takes no packed weights of this dtype on this CPU")
    if path == gemm.ONEDNN_FP32 and not HAS_ONEDNN:
        pytest.skip("this torch has no oneDNN")
    if path is not None:
        monkeypatch.setitem(gemm._PATHS, dtype, path)
    layer = Linear(64, 48, bias=True).to(dtype)
    with torch.no_grad():
        layer.weight.normal_()
        layer.bias.normal_()
    x = torch.randn(3, 16, 64).to(dtype)
    ref = F.linear(x.double(), layer.weight.double(), layer.bias.double())
    with torch.inference_mode():
        for got in (layer(x), gemm.linear(x, layer.weight, layer.bias)):
            assert got.dtype == dtype and got.shape == (3, 16, 48)
            torch.testing.assert_close(got.double(), ref, atol=0.1, rtol=2e-2)
    assert ("_onednn_weight" in layer.__dict__) == (gemm._path(dtype) != gemm.TORCH)


def caps(onednn=True, onednn_bf16=True, native=True):
    return CpuCaps(onednn=onednn, onednn_bf16=onednn_bf16, native_bf16=native, aten="AVX512")


@pytest.mark.parametrize("dtype, cpu, path", [
    (torch.float32, caps(), gemm.ONEDNN),
    (torch.float32, caps(onednn_bf16=False, native=False), gemm.ONEDNN),
    (torch.float32, caps(onednn=False), gemm.TORCH),
    (torch.bfloat16, caps(), gemm.ONEDNN),  # AVX512-BF16, AMX, AVX-NE-CONVERT
    (torch.bfloat16, caps(native=False), gemm.ONEDNN_FP32),  # AVX-512 without BF16: oneDNN emulates, slower
    (torch.bfloat16, caps(onednn_bf16=False, native=False), gemm.ONEDNN_FP32),  # AVX2: oneDNN refuses bf16
    (torch.bfloat16, caps(onednn_bf16=False), gemm.ONEDNN_FP32),  # the instructions, but oneDNN says no
    (torch.bfloat16, caps(onednn=False), gemm.TORCH),
    (torch.float16, caps(), gemm.ONEDNN_FP32),
    (torch.float16, caps(onednn=False), gemm.TORCH),
    (torch.float64, caps(), gemm.TORCH),
])
def test_path_policy(dtype, cpu, path):
    assert gemm.cpu_gemm_path(dtype, cpu) == path


@pytest.mark.parametrize("flags, cap, native", [
    ({"avx2", "avx512f", "avx512_bf16"}, None, True),
    ({"avx2", "amx_bf16"}, "ALL", True),
    ({"avx2", "avx_ne_convert"}, "AVX2_VNNI_2", True),
    ({"avx2", "avx512f", "avx512_bf16"}, "AVX2", False),  # oneDNN capped below the instructions
    ({"avx2", "avx512f", "avx512_bf16"}, "avx512_core", False),
    ({"avx2", "avx512f", "avx512_bf16"}, "AVX512_CORE_BF16", True),
    ({"avx2", "avx512f", "avx512bw"}, None, False),
    ({"fp", "asimd", "bf16"}, None, True),  # aarch64
    (set(), None, False),
])
def test_native_bf16_from_flags_and_cap(flags, cap, native):
    assert native_bf16(frozenset(flags), cap) == native


@pytest.mark.skipif(not HAS_ONEDNN, reason="this torch has no oneDNN")
def test_cpu_inference_uses_onednn_and_autograd_does_not():
    x, w = torch.randn(4, 8), torch.randn(6, 8)
    with torch.inference_mode():
        assert gemm.uses_onednn(x, w)
    assert not gemm.uses_onednn(x.requires_grad_(), w)  # oneDNN's op has no backward here: F.linear keeps autograd
    assert not gemm.uses_onednn(x.detach().double(), w.double())
    y = gemm.linear(x, w)
    y.sum().backward()
    torch.testing.assert_close(x.grad, w.sum(0).expand(4, 8))


@pytest.mark.skipif(not HAS_ONEDNN, reason="this torch has no oneDNN")
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
