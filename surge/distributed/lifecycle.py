"""A child process's tie to its parent: die when the parent goes, however it ends. Worker ranks and weight-cache
daemons call `die_with_parent` first thing, before anything they start could outlive an engine that is gone.
"""
from __future__ import annotations

import ctypes
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
