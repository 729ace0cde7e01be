"""Kernel tests run Triton's interpreter on the CPU. The variable must be set before triton.language is imported:
tests/conftest.py sets it for the whole suite; here again for a run of this package alone."""
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


def _patch_interpreter_fp8() -> bool:
    """Make Triton's interpreter convert to and from float8e4nv as the GPU does. It keeps fp8 as raw uint8 and its
    float -> fp8 rounding drops the carry when the rounded mantissa overflows (125.8 became 64, not 128); the GPU
    rounds to nearest even (cvt.rn.satfinite). Conversions of float8e4nv go through torch's float8_e4m3fn instead,
    which rounds so (the kernels saturate before converting). Returns False when the interpreter moved."""
    try:
        import numpy as np
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    builder = getattr(interpreter, "InterpreterBuilder", None)
    handle = getattr(interpreter, "TensorHandle", None)
    if builder is None or handle is None or not hasattr(builder, "create_fp_to_fp"):
        return False
    if getattr(builder, "_surge_fp8", False):
        return True
    fp_to_fp = builder.create_fp_to_fp
    torch_of = {tl.float32: torch.float32, tl.float16: torch.float16, tl.bfloat16: torch.bfloat16,
                tl.float8e4nv: torch.float8_e4m3fn}
    bits = {torch.bfloat16: (np.int16, torch.int16, np.uint16), torch.float8_e4m3fn: (np.uint8, torch.uint8, np.uint8)}

    def as_torch(data, dtype):  # bf16 and fp8 are held as raw unsigned integers
        if dtype not in bits:
            return torch.from_numpy(np.ascontiguousarray(data))
        np_int, torch_int, _ = bits[dtype]
        return torch.from_numpy(np.ascontiguousarray(data).view(np_int)).view(dtype)

    def as_raw(t):
        if t.dtype not in bits:
            return t.numpy()
        _, torch_int, np_raw = bits[t.dtype]
        return t.view(torch_int).numpy().view(np_raw)

    def convert(self, src, dst_type, rounding_mode):
        src_t, dst_t = torch_of.get(src.dtype.scalar), torch_of.get(dst_type.scalar)
        if tl.float8e4nv not in (src.dtype.scalar, dst_type.scalar) or src_t is None or dst_t is None:
            return fp_to_fp(self, src, dst_type, rounding_mode)
        return handle(as_raw(as_torch(src.data, src_t).to(dst_t)), dst_type.scalar)

    builder.create_fp_to_fp, builder._surge_fp8 = convert, True
    return True


_FP8 = torch.cuda.is_available() or _patch_interpreter_fp8()


def _patch_interpreter_device_calls() -> bool:
    """Speed only. Triton's interpreter re-patches triton.language (inspect.getmembers over its modules) at every
    call of one @triton.jit function from another: a third of an interpreted kernel's time. Within one launch only the
    first such patch of a module's globals does anything (the launch itself patches its kernel's; those patches are
    never restored before the launch's own restore puts the originals back, so repeating them is a no-op); skip the
    repeats. Returns False when the interpreter's internals moved (then nothing changes)."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    executor = getattr(interpreter, "GridExecutor", None)
    function = getattr(interpreter, "InterpretedFunction", None)
    error = getattr(interpreter, "InterpreterError", None)
    if executor is None or function is None or error is None or not hasattr(function, "rewrite"):
        return False
    if getattr(function, "_surge_fast_calls", False):
        return True
    launch, device_call = executor.__call__, function.__call__
    running: list[set[int]] = []  # per launch in progress: ids of the globals whose modules it has patched

    def launch_fast(self, *args, **kwargs):
        running.append({id(self.fn.__globals__)})
        try:
            return launch(self, *args, **kwargs)
        finally:
            running.pop()

    def device_call_fast(self, *args, **kwargs):
        if not running or id(self.fn.__globals__) not in running[-1]:
            if running:
                running[-1].add(id(self.fn.__globals__))
            return device_call(self, *args, **kwargs)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # as the interpreter's own device call
            raise error(repr(e)) from e

    executor.__call__, function.__call__, function._surge_fast_calls = launch_fast, device_call_fast, True
    return True


if not torch.cuda.is_available():
    _patch_interpreter_device_calls()


@pytest.fixture
def require_bf16_dot() -> None:
    if not _BF16_DOT:
        pytest.skip("this Triton interpreter cannot run bf16 tl.dot")


@pytest.fixture
def require_fp8() -> None:
    if not _FP8:
        pytest.skip("this Triton interpreter cannot convert float8e4nv as the GPU does")


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
