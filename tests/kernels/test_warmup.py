"""compile_many with a fake compile function: dedupe, cached keys skipped, worker cap, strict write-back, and the
warning for a variant first compiled after warm-up. Keys come from the kernel's own dispatch, as at runtime."""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import pytest

from surge.kernels.warmup import CompiledKernel, write_back


@dataclass(frozen=True)
class FakeKey:
    block: int


class FakeKernel(CompiledKernel):
    def __init__(self, delay: float = 0.0) -> None:
        super().__init__()
        self.calls: list[FakeKey] = []
        self.delay = delay
        self.active = 0
        self.peak = 0
        self._count_lock = threading.Lock()

    def dispatch(self, batch: int) -> FakeKey:  # the runtime's key function: a policy of capacities
        return FakeKey(16 if batch <= 4 else 64)

    def compile(self, key: FakeKey) -> str:
        with self._count_lock:
            self.calls.append(key)
            self.active += 1
            self.peak = max(self.peak, self.active)
        time.sleep(self.delay)
        with self._count_lock:
            self.active -= 1
        return f"binary-{key.block}"


class ParallelFakeKernel(FakeKernel):
    parallel_compile = True


def test_dedupes_and_skips_compiled_keys():
    kernel = FakeKernel()
    keys = [kernel.dispatch(b) for b in (1, 2, 3, 8, 9)]  # two distinct keys
    assert kernel.compile_many(keys) == 2
    assert sorted(k.block for k in kernel.calls) == [16, 64]
    assert kernel.is_compiled(FakeKey(16)) and kernel._compiled[FakeKey(64)] == "binary-64"
    assert kernel.compile_many(keys + [FakeKey(128)]) == 1  # only the new one
    assert sorted(k.block for k in kernel.calls) == [16, 64, 128]


def test_serial_by_default():
    kernel = FakeKernel(delay=0.02)
    kernel.compile_many([FakeKey(b) for b in range(6)], max_workers=4)
    assert kernel.peak == 1 and len(kernel.calls) == 6


@pytest.mark.parametrize("cap", [1, 2, 3])
def test_parallel_respects_the_worker_cap(cap):
    kernel = ParallelFakeKernel(delay=0.05)
    assert kernel.compile_many([FakeKey(b) for b in range(8)], max_workers=cap) == 8
    assert kernel.peak <= cap
    if cap > 1:
        assert kernel.peak > 1  # it did overlap
    assert all(kernel._compiled[FakeKey(b)] == f"binary-{b}" for b in range(8))


def test_default_cap_is_four():
    kernel = ParallelFakeKernel(delay=0.05)
    kernel.compile_many([FakeKey(b) for b in range(12)])
    assert kernel.peak <= 4


def test_write_back_is_strict():
    cache: dict = {}
    with pytest.raises(ValueError):  # a result missing
        write_back(cache, [FakeKey(1), FakeKey(2)], [(FakeKey(1), "a")])
    with pytest.raises(ValueError):  # a result too many
        write_back(cache, [FakeKey(1)], [(FakeKey(1), "a"), (FakeKey(2), "b")])
    with pytest.raises(RuntimeError, match="slot of"):  # results out of order
        write_back(cache, [FakeKey(1), FakeKey(2)], [(FakeKey(2), "b"), (FakeKey(1), "a")])
    assert cache == {}  # nothing filed on failure
    write_back(cache, [FakeKey(1)], [(FakeKey(1), "a")])
    assert cache == {FakeKey(1): "a"}


def test_compile_many_fails_loudly_on_a_misfiled_result():
    class Misfiling(ParallelFakeKernel):
        def _compile_keyed(self, key):
            return FakeKey(key.block + 1), self.compile(key)

    kernel = Misfiling()
    with pytest.raises(RuntimeError, match="slot of"):
        kernel.compile_many([FakeKey(1), FakeKey(5)])
    assert not kernel.is_compiled(FakeKey(1))


def test_first_compile_after_warm_up_warns():
    kernel = FakeKernel()
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("surge.kernels.warmup")  # the surge logger does not propagate to the root
    logger.addHandler(handler)
    try:
        kernel.ensure(kernel.dispatch(1))  # before warm-up: silent
        kernel.compile_many([kernel.dispatch(1)])
        kernel.ensure(kernel.dispatch(2))  # same key: compiled
        assert not [r for r in records if r.levelno >= logging.WARNING]
        kernel.ensure(kernel.dispatch(100))
        kernel.ensure(kernel.dispatch(100))  # warned once
        warnings = [r.getMessage() for r in records if r.levelno >= logging.WARNING]
        assert len(warnings) == 1 and "after warm-up" in warnings[0] and "block=64" in warnings[0]
    finally:
        logger.removeHandler(handler)


def test_rejects_a_bad_worker_count():
    with pytest.raises(ValueError, match="max_workers"):
        FakeKernel().compile_many([FakeKey(1)], max_workers=0)
