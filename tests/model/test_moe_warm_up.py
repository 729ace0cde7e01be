"""The MoE kernel warm-up (surge/model/layers/moe.py's moe_kernel_keys, compiled by the engine's parallel kernel
warm-up) covers what the CUDA graphs' steps launch, so that no capture waits for Triton's compiler.

Checked twice on a tiny Qwen3-MoE (8 experts, 3 per token): at the wrappers' keys (each step's dispatched keys are
among the warm-up's) and, independently of how those keys are built, at Triton's own variant signature (each runtime
launch's kernel, compile-time arguments, and its arguments' specialization as Triton computes it, against the
signatures of the launches the warm-up's compile makes on meta tensors). Token counts cross the policies' boundaries:
the pair path (<= 2 tokens here) and the grouped one, block_m 16 / 32 / 64, Triton's specialization of 1 and of
multiples of 16. The kernels do not run (their launches are recorded instead): only their variants are under test.
"""
from __future__ import annotations

import functools

import pytest
import torch
from torch import nn
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend

import surge.kernels.fused_moe as fused_moe_module
import surge.kernels.moe_routing as moe_routing_module
import surge.model.layers.moe as moe
from surge.engine.args import read_model_config
from surge.kernels.fused_moe import FUSED_MOE, FusedMoeKernels, _pair_gate_up_kernel, _gate_up_act_kernel
from surge.kernels.moe_routing import ROUTER, MoeRouter
from surge.kernels.warmup import compiling
from surge.model.layers.moe import SparseMoeBlock, moe_kernel_keys
from surge.model.loader.base import build_model
from surge.model.quant.base import MoEMethod
from surge.worker.cuda_graph import capture_sizes, mixed_capture_sizes
from tiny_models import make_tiny_model

TOKEN_COUNTS = [1, 2, 3, 16, 17, 24, 48, 512]


def _signature(kernel, args, constexprs) -> tuple:
    """A launch's Triton variant: the kernel, its compile-time arguments, and each argument's type and
    specialization (a tensor: its dtype and whether its pointer is 16-byte aligned; a meta tensor stands for an
    aligned one)."""
    spec = []
    for a in args:
        if isinstance(a, torch.Tensor):
            spec.append((str(a.dtype), a.device.type == "meta" or a.data_ptr() % 16 == 0))
        else:
            spec.append(native_specialize_impl(BaseBackend, a, False, True, True))
    return kernel, tuple(spec), tuple(sorted(constexprs.items()))


@pytest.fixture
def tiny_moe(tmp_path, monkeypatch):
    """The tiny model, its MoE blocks taking the CUDA path on the CPU, every MoE launch recorded (not run): returns
    (model, launched signatures, warm-up signatures, dispatched keys)."""
    model = build_model(read_model_config(make_tiny_model("qwen3-moe", tmp_path / "m"), "float32",
                                          torch.device("cpu")), torch.device("cpu"))
    launched, warmed, dispatched = set(), set(), {ROUTER: set(), FUSED_MOE: set()}

    def record(kernel, grid, args, constexprs):
        (warmed if compiling() else launched).add(_signature(kernel, args, constexprs))

    for module in (fused_moe_module, moe_routing_module):
        monkeypatch.setattr(module, "launch_kernel", record)
    for wrapper in dispatched:
        monkeypatch.setattr(wrapper, "ensure", dispatched[wrapper].add)
    monkeypatch.setattr(moe, "select_experts", functools.partial(moe.select_experts, use_kernel=True))
    monkeypatch.setattr(MoEMethod, "apply", MoEMethod.apply_kernels)
    return model, launched, warmed, dispatched


def _warm_up(model: nn.Module, token_counts: list[int]) -> dict:
    """moe_kernel_keys compiled by fresh wrappers (the process-wide ones may hold other tests' keys already)."""
    keys = moe_kernel_keys(model, token_counts)
    for kernel, ks in keys.items():
        assert type(kernel)().compile_many(ks, max_workers=2) == len(set(ks))
    return keys


def _steps(model: nn.Module, token_counts: list[int]) -> None:
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    assert len(blocks) == 3  # layer 2 is dense
    with torch.inference_mode():
        for t in token_counts:
            for block in blocks:
                block(torch.randn(t, 64))


def test_warm_up_covers_every_launch_of_the_graphs_token_counts(tiny_moe):
    model, launched, warmed, dispatched = tiny_moe
    keys = _warm_up(model, TOKEN_COUNTS)
    _steps(model, TOKEN_COUNTS)
    kernels = {sig[0] for sig in launched}
    assert _pair_gate_up_kernel in kernels and _gate_up_act_kernel in kernels  # both paths ran
    assert launched <= warmed, sorted(map(str, launched - warmed))
    for wrapper, ks in keys.items():
        assert dispatched[wrapper] and dispatched[wrapper] <= set(ks), wrapper.name


def test_a_token_count_left_out_of_the_warm_up_shows(tiny_moe):
    """The check can fail: one token (the router's token count specialized as the constant 1) warmed up as two."""
    model, launched, warmed, dispatched = tiny_moe
    keys = _warm_up(model, [2])
    _steps(model, [1])
    assert not launched <= warmed
    assert not dispatched[ROUTER] <= set(keys[ROUTER])


def test_qwen3_30b_a3b_keys_without_a_gpu():
    """Qwen3-30B-A3B's layer shape (128 experts, 8 per token, hidden 2048, experts' intermediate 768), on the meta
    device: the warm-up's keys come from shapes alone. The pair path up to 16 tokens (one pair per expert), the
    grouped path beyond; one router and one expert key per token count at most."""
    with torch.device("meta"):
        block = SparseMoeBlock(2048, 128, 8, 768, norm_topk_prob=True)
    counts = sorted(set(capture_sizes(64)) | set(mixed_capture_sizes(8192)))
    keys = moe_kernel_keys(nn.ModuleList([block]), counts)
    experts = keys[FUSED_MOE]
    assert len(experts) == len(keys[ROUTER]) == len(counts)
    pairs = [k.num_tokens for k in experts if k.launch.pairs is not None]
    assert pairs == [t for t in counts if t <= 16]
    assert all(k.align is not None for k in experts if k.launch.pairs is None)
    assert {k.launch.block_m for k in experts} == {16, 32}
    assert isinstance(FUSED_MOE, FusedMoeKernels) and isinstance(ROUTER, MoeRouter)
