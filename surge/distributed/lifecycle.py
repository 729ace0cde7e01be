"""A process's life around its engine: a child's tie to its parent (die when the parent goes, however it ends:
worker ranks and weight-cache daemons call `die_with_parent` first thing), and the end of start-up, after which
the long-lived objects it made are frozen out of the garbage collector's walks.
"""
from __future__ import annotations

import ctypes
import gc
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


class ParentGone(SystemExit):
    pass


def die_with_parent(parent_pid: int, sig: signal.Signals = signal.SIGKILL) -> None:
    """Linux: the kernel sends `sig` to this process when its parent exits, however the parent ends."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before the line above took effect
        raise ParentGone(1)


def freeze_startup_objects() -> None:
    """Move everything start-up made (the model, CUDA graphs, tables: long-lived) out of the garbage collector's
    view, so a collection while serving walks only what serving allocated."""
    gc.collect()
    gc.freeze()


def unfreeze_objects() -> None:
    """Undo freeze_startup_objects when an engine shuts down: frozen objects are never collected, so a reference
    cycle through a stopped engine (its model, KV cache, CUDA graphs) would hold its device memory for good, and a
    process that starts another engine after it (benchmarks comparing modes, tests) would run out."""
    gc.unfreeze()
