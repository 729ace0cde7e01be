"""Kernel wrappers that remember which launch keys they compiled, and `compile_many` to compile a warm-up set.

Warm-up keys come from the wrapper's own `dispatch` (the function the runtime calls before each launch), so warm-up
and runtime cannot disagree about what a variant is. Compilation is serial unless a kernel opts in.
"""
from __future__ import annotations

import os
import threading
import time
from collections.abc import Hashable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import ClassVar

import torch

from surge.logger import init_logger

logger = init_logger(__name__)

DEFAULT_MAX_WORKERS = 4


class CompiledKernel:
    """Base for a kernel wrapper: subclasses define `dispatch(...) -> key` (a hashable launch key, e.g. a frozen
    dataclass of dtypes, shapes and launch policy) and `compile(key)`, which compiles that variant without running
    it. The runtime calls `ensure(key)` before launching; a key first seen after warm-up logs a warning, since its
    compile then lands inside a request (or inside a CUDA graph capture)."""

    # Triton's compiler releases the GIL for most of its work, so threads overlap; kernels opt in once their
    # compile path is known to be thread-safe.
    parallel_compile: ClassVar[bool] = False

    def __init__(self) -> None:
        self._compiled: dict[Hashable, object] = {}
        self._lock = threading.Lock()
        self._warmed_up = False

    @property
    def name(self) -> str:
        return type(self).__name__

    def compile(self, key: Hashable) -> object:
        raise NotImplementedError

    def is_compiled(self, key: Hashable) -> bool:
        return key in self._compiled

    def ensure(self, key: Hashable) -> None:
        """Called on the launch path. The launch itself compiles a missing variant (Triton's JIT); this records
        the key and warns when warm-up missed it."""
        if key in self._compiled:
            return
        with self._lock:
            if key in self._compiled:
                return
            if self._warmed_up:
                logger.warning("%s: compiling %r for the first time after warm-up; add it to the warm-up keys",
                               self.name, key)
            self._compiled[key] = None

    def compile_many(self, keys: Iterable[Hashable], max_workers: int = DEFAULT_MAX_WORKERS) -> int:
        """Compiles every key not compiled yet (duplicates once); returns how many were compiled.

        Parallel (at most `max_workers` threads) only when the kernel sets `parallel_compile`."""
        if max_workers < 1:
            raise ValueError(f"max_workers={max_workers!r} must be >= 1")
        unique = list(dict.fromkeys(keys))
        missing = [k for k in unique if k not in self._compiled]
        start = time.perf_counter()
        workers = min(max_workers, len(missing), os.cpu_count() or 1) if self.parallel_compile else 1
        results = self._compile_all(missing, workers)
        write_back(self._compiled, missing, results)
        self._warmed_up = True
        if missing:
            logger.info("%s: compiled %d variant(s) (%d already compiled) in %.2f s with %d worker(s)", self.name,
                        len(missing), len(unique) - len(missing), time.perf_counter() - start, workers)
        return len(missing)

    def _compile_all(self, keys: Sequence[Hashable], workers: int) -> list[tuple[Hashable, object]]:
        if workers <= 1:
            return [self._compile_keyed(k) for k in keys]
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"compile-{self.name}") as pool:
            return list(pool.map(self._compile_keyed, keys))

    def _compile_keyed(self, key: Hashable) -> tuple[Hashable, object]:
        return key, self.compile(key)


def write_back(cache: dict, keys: Sequence[Hashable], results: Sequence[tuple[Hashable, object]]) -> None:
    """Stores results in `cache`, pairing them with `keys` strictly: a missing or extra result, or a result whose
    key is not the one asked for at its position, raises instead of filing an artifact under the wrong key."""
    pairs = []
    for key, (result_key, artifact) in zip(keys, results, strict=True):
        if result_key != key:
            raise RuntimeError(f"compile result for {result_key!r} came back in the slot of {key!r}")
        pairs.append((key, artifact))
    cache.update(pairs)


_compile_only = threading.local()


@contextmanager
def compile_only() -> Iterator[None]:
    """Within (on this thread): `launch` compiles each kernel variant instead of running it, so that a wrapper's
    `compile` can run its real launch code, on meta tensors (only their dtypes, shapes and strides are read), and
    cannot drift from it."""
    _compile_only.on = True
    try:
        yield
    finally:
        _compile_only.on = False


def compiling() -> bool:
    return getattr(_compile_only, "on", False)


def launch(kernel, grid: tuple[int, ...], args: Sequence, constexprs: dict) -> object:
    """kernel[grid](*args, **constexprs), or within `compile_only` its compilation alone: a tensor argument is
    passed as its dtype (Triton then specializes it as a 16-byte aligned pointer, as every launch's tensors are).
    Keys of one wrapper often share a variant (a layer's combine at every token count): each variant compiles once,
    a second thread asking for it waits for the first instead of compiling it again."""
    if not compiling():
        return kernel[grid](*args, **constexprs)
    args = tuple(a.dtype if isinstance(a, torch.Tensor) else a for a in args)
    variant = (kernel, tuple(_specialization(a) for a in args), tuple(sorted(constexprs.items())))
    with _variants_lock:
        lock = _variant_locks.setdefault(variant, threading.Lock())
    with lock:
        if variant not in _variants_compiled:
            _variants_compiled[variant] = kernel.warmup(*args, grid=grid, **constexprs)
        return _variants_compiled[variant]


_variants_lock = threading.Lock()
_variant_locks: dict[tuple, threading.Lock] = {}
_variants_compiled: dict[tuple, object] = {}


def triton_int_class(value: int) -> int:
    """How Triton specializes an integer argument's value (beyond i32 / i64): 1 (a constant), a multiple of 16, or
    neither (0). A key holds this for each argument that follows the token count."""
    return 1 if value == 1 else 16 if value % 16 == 0 else 0


def _specialization(arg: object) -> Hashable:
    """What of an argument Triton compiles a variant for (at least): an integer's class and range (i32 or i64), a
    float's type; anything else (dtypes, None) itself."""
    if isinstance(arg, bool) or not isinstance(arg, int | float):
        return arg
    if isinstance(arg, float):
        return float
    return int, triton_int_class(arg), -2 ** 31 <= arg < 2 ** 31
