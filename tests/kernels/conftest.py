"""Kernel tests run Triton's interpreter on the CPU. The variable must be set before any kernel is decorated, so
surge.kernels modules are imported only inside tests (the packages imported earlier never import them)."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


def _patch_interpreter_bf16() -> bool:
    """Make Triton's interpreter treat bfloat16 as the GPU does. It keeps bf16 as raw uint16, so tl.dot multiplied
    those integers; widen them to float32 first (exact). And it rounds float32 -> bf16 toward zero where the GPU
    rounds to nearest even. Returns False when the interpreter's internals moved (bf16 tests then skip)."""
    try:
        import numpy as np
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    builder = getattr(interpreter, "InterpreterBuilder", None)
    handle = getattr(interpreter, "TensorHandle", None)
    if builder is None or handle is None or not all(hasattr(builder, m) for m in ("create_dot", "cast_impl")):
        return False
    if getattr(builder, "_surge_bf16", False):
        return True
    create_dot, cast_impl = builder.create_dot, builder.cast_impl

    def as_f32(t):
        if t.dtype.scalar == tl.bfloat16:
            return (t.data.astype(np.uint32) << 16).view(np.float32)
        return t.data.astype(np.float32)

    def dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if tl.bfloat16 in (a.dtype.scalar, b.dtype.scalar):
            return handle(np.matmul(as_f32(a), as_f32(b), dtype=d.data.dtype) + d.data, d.dtype.scalar)
        return create_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    def cast(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = src.data.astype(np.float32).view(np.uint32).astype(np.uint64)
            rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
            rounded = np.where(np.isnan(src.data), np.uint16(0x7FC0), rounded)
            return handle(rounded, dst_type.scalar)
        return cast_impl(self, src, dst_type)

    builder.create_dot, builder.cast_impl, builder._surge_bf16 = dot, cast, True
    return True


_BF16_DOT = torch.cuda.is_available() or _patch_interpreter_bf16()


@pytest.fixture
def require_bf16_dot() -> None:
    if not _BF16_DOT:
        pytest.skip("this Triton interpreter cannot run bf16 tl.dot")


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
