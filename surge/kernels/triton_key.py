"""Triton's version key, computed once per installation instead of once per process.

Before a process compiles or loads its first kernel, Triton hashes its own compiler sources and its whole native
library (`triton_key()`, ~0.4 s on the H200 host, the largest share of a warm start's kernel warm-up). The key
only changes when those files do, so it is kept in Triton's cache directory (beside the kernels it indexes) under
a fingerprint of the same files' paths, sizes and modification times, and Triton's function is replaced by one
that returns it. A file rewritten in place with the same size and time would go unnoticed:
SURGE_TRITON_KEY_CACHE=0 turns this off.
"""
from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

from surge import envs
from surge.logger import init_logger

logger = init_logger(__name__)

_HASHED_DIRS = ("compiler", "backends", "language", "_C")  # what triton_key() reads, and the rest of them


def _fingerprint(triton_dir: Path, version: str) -> str:
    h = hashlib.sha256(version.encode())
    for sub in _HASHED_DIRS:
        for root, dirs, files in os.walk(triton_dir / sub):
            dirs.sort()
            for name in sorted(files):
                path = os.path.join(root, name)
                st = os.stat(path)
                h.update(f"{path}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    runtime_cache = triton_dir / "runtime" / "cache.py"
    st = runtime_cache.stat()
    h.update(f"{runtime_cache}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:32]


def _cache_dir() -> Path:
    return Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")


@functools.cache
def use_cached_triton_key() -> bool:
    """Install the cached key (computing and storing it on the first run); True if installed. Idempotent."""
    if not envs.SURGE_TRITON_KEY_CACHE:
        return False
    import triton
    import triton.runtime.cache as cache
    triton_dir = Path(triton.__file__).parent
    path = _cache_dir() / f"surge-triton-key-{_fingerprint(triton_dir, triton.__version__)}.txt"
    try:
        key = path.read_text()
    except OSError:
        key = cache.triton_key()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(key)
            os.replace(tmp, path)
        except OSError as e:  # a read-only cache: Triton's own key still serves this process
            logger.debug("could not store Triton's key in %s: %s", path, e)
    if not key.startswith(triton.__version__):
        return False  # not a key Triton wrote (a damaged file): keep Triton's own function
    cached = functools.lru_cache(lambda: key)
    cache.triton_key = cached
    import triton.runtime.autotuner as autotuner  # imports the function by name
    autotuner.triton_key = cached
    return True
