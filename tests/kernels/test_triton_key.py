"""The cached Triton key equals the one Triton computes, and a changed file (size or time) gives a new fingerprint."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")


def test_cached_key_equals_tritons_and_is_reused(tmp_path, monkeypatch):
    import triton.runtime.cache as cache
    from surge.kernels import triton_key
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    original = cache.triton_key
    monkeypatch.setattr(cache, "triton_key", original)  # restored after the test
    import triton.runtime.autotuner as autotuner
    monkeypatch.setattr(autotuner, "triton_key", autotuner.triton_key)
    triton_key.use_cached_triton_key.cache_clear()
    try:
        assert triton_key.use_cached_triton_key()
        stored = list(tmp_path.glob("surge-triton-key-*.txt"))
        assert len(stored) == 1 and stored[0].read_text() == original()
        assert cache.triton_key() == original() and autotuner.triton_key() == original()
        # A second process finds the file: it reads the key rather than hashing (a planted value shows it).
        monkeypatch.setattr(cache, "triton_key", original)
        stored[0].write_text(triton.__version__ + "-planted")
        triton_key.use_cached_triton_key.cache_clear()
        assert triton_key.use_cached_triton_key() and cache.triton_key() == triton.__version__ + "-planted"
    finally:
        triton_key.use_cached_triton_key.cache_clear()


def test_fingerprint_follows_size_and_time(tmp_path):
    from surge.kernels.triton_key import _fingerprint
    for sub in ("compiler", "backends", "language", "_C", "runtime"):
        (tmp_path / sub).mkdir()
    (tmp_path / "runtime" / "cache.py").write_text("x")
    lib = tmp_path / "_C" / "libtriton.so"
    lib.write_bytes(b"abc")
    first = _fingerprint(tmp_path, "3.6.0")
    assert _fingerprint(tmp_path, "3.6.0") == first and _fingerprint(tmp_path, "3.7.0") != first
    st = lib.stat()
    os.utime(lib, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    assert _fingerprint(tmp_path, "3.6.0") != first
    lib.write_bytes(b"abcd")
    assert _fingerprint(Path(tmp_path), "3.6.0") != first


def test_off_switch(monkeypatch):
    from surge.kernels import triton_key
    monkeypatch.setenv("SURGE_TRITON_KEY_CACHE", "0")
    triton_key.use_cached_triton_key.cache_clear()
    try:
        assert not triton_key.use_cached_triton_key()
    finally:
        triton_key.use_cached_triton_key.cache_clear()
