"""Process checks shared by the tests that start and kill engines, servers, ranks and daemons."""
from __future__ import annotations

from pathlib import Path


def pid_alive(pid: int) -> bool:
    """Running, as opposed to gone or a zombie waiting for its (new) parent to reap it."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
