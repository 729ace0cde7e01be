"""A shared-memory ring: one writer broadcasts byte messages to a fixed set of readers on the same node.

Each slot has a `published` byte and one `read` flag per reader (single bytes, so every store is atomic). The writer
fills a slot only once every reader has read it, then publishes it with the lap's tag (which pass over the ring this
is, 1..255); a reader takes the slot when the tag is the one its own lap expects. Readiness is that one load: a
check of two bytes (written, and not yet read by me) could see the old message's `written` and then the flag the
writer had just cleared for the new one, and take a half-written slot. A message larger than a slot streams
through several. Waits spin
briefly (a step is milliseconds away), then sleep, and call `check` every few milliseconds so a dead peer ends
the wait with its error instead of a hang.
"""
from __future__ import annotations

import _posixshmem
import mmap
import os
import secrets
import struct
import time
from collections.abc import Callable

import msgspec

_SPIN_SECONDS = 0.005  # busy-wait (yielding the CPU) this long before sleeping
_LONG_IDLE_SECONDS = 1.0  # after this, sleep in longer naps: the engine is idle
_CHECK_INTERVAL = 0.02
_CHUNK_HEADER = struct.Struct("<IB")  # payload length, 1 if the message's last chunk


class RingHandle(msgspec.Struct, array_like=True):
    """What a reader needs to attach."""
    name: str
    num_readers: int
    slot_bytes: int
    num_slots: int


def wait_until(ready: Callable[[], bool], check: Callable[[], None] | None = None,
               timeout: float | None = None, what: str = "a message",
               idle: Callable[[], None] | None = None) -> None:
    """Poll `ready` until true; `check` raises to abort (a peer died); TimeoutError after `timeout` seconds.
    `idle`, if given, runs at every poll (a worker hands back a finished result while it waits)."""
    if ready():
        return
    start = last_check = time.monotonic()
    while not ready():
        if idle is not None:
            idle()
        now = time.monotonic()
        waited = now - start
        if waited < _SPIN_SECONDS:
            os.sched_yield()
        else:
            time.sleep(1e-4 if waited < _LONG_IDLE_SECONDS else 2e-3)
        if now - last_check >= _CHECK_INTERVAL:
            last_check = now
            if check is not None:
                check()
            if timeout is not None and waited > timeout:
                raise TimeoutError(f"no progress on {what} for {timeout:.0f} s")


class ShmRing:
    def __init__(self, handle: RingHandle, reader: int | None, create: bool) -> None:
        """reader: this process's reader index, or None for the writer."""
        self.handle = handle
        self.reader = reader
        n = handle.num_readers
        self._meta_stride = 1 + n
        meta_bytes = handle.num_slots * self._meta_stride
        self._data_offset = -(-meta_bytes // 64) * 64
        size = self._data_offset + handle.num_slots * handle.slot_bytes
        # POSIX shared memory without multiprocessing's resource tracker (one more process per worker); the
        # writer's side unlinks the name once every reader has attached.
        if create:
            self.handle = handle = RingHandle(f"/surge-{os.getpid()}-{secrets.token_hex(4)}", n,
                                              handle.slot_bytes, handle.num_slots)
            fd = _posixshmem.shm_open(handle.name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
            try:
                os.ftruncate(fd, size)  # zero-filled: every flag starts cleared
            except OSError:
                os.close(fd)
                _posixshmem.shm_unlink(handle.name)
                raise
        else:
            fd = _posixshmem.shm_open(handle.name, os.O_RDWR, mode=0o600)
        try:
            self._mmap = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._buf = memoryview(self._mmap)
        self._index = 0  # the next slot this process writes or reads, counted from the start

    @staticmethod
    def create(num_readers: int, reader: int | None = None, slot_bytes: int = 1 << 20,
               num_slots: int = 8) -> ShmRing:
        """A new ring; the creating process is its writer, or reader `reader`."""
        if slot_bytes <= _CHUNK_HEADER.size:
            raise ValueError(f"slot_bytes={slot_bytes} must exceed the chunk header ({_CHUNK_HEADER.size} bytes)")
        return ShmRing(RingHandle("", num_readers, slot_bytes, num_slots), reader=reader, create=True)

    @staticmethod
    def attach(handle: RingHandle, reader: int | None) -> ShmRing:
        return ShmRing(handle, reader, create=False)

    def unlink(self) -> None:
        """Remove the name once every peer has attached: nothing is left behind however the processes end."""
        try:
            _posixshmem.shm_unlink(self.handle.name)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        if self._buf is None:
            return
        self._buf.release()
        self._buf = None
        self._mmap.close()

    # ---- writer ----
    def write(self, data: bytes, check: Callable[[], None] | None = None, timeout: float | None = None) -> None:
        assert self.reader is None, "only the writer writes"
        payload_max = self.handle.slot_bytes - _CHUNK_HEADER.size
        view = memoryview(data)
        offset = 0
        while True:
            chunk = view[offset:offset + payload_max]
            offset += len(chunk)
            self._write_chunk(chunk, last=offset >= len(data), check=check, timeout=timeout)
            if offset >= len(data):
                return

    def _write_chunk(self, chunk: memoryview, last: bool, check, timeout) -> None:
        h = self.handle
        slot = self._index % h.num_slots
        meta = slot * self._meta_stride
        buf = self._buf
        readers = range(meta + 1, meta + 1 + h.num_readers)
        if self._index >= h.num_slots:  # the slot holds the last lap's message until every reader has read it
            wait_until(lambda: all(buf[i] for i in readers), check, timeout, "a free ring slot")
        buf[meta] = 0  # first unpublish, so no reader takes the slot while it is rewritten
        for i in readers:
            buf[i] = 0
        start = self._data_offset + slot * h.slot_bytes
        _CHUNK_HEADER.pack_into(buf, start, len(chunk), int(last))
        body = start + _CHUNK_HEADER.size
        buf[body:body + len(chunk)] = chunk
        buf[meta] = self._lap_tag()
        self._index += 1

    def _lap_tag(self) -> int:
        """The published byte of the slot at this process's index: never 0 (unpublished), and a reader cannot fall
        a whole 255 laps behind, since the writer waits for it."""
        return (self._index // self.handle.num_slots) % 255 + 1

    # ---- reader ----
    def read(self, check: Callable[[], None] | None = None, timeout: float | None = None,
             idle: Callable[[], None] | None = None) -> bytes:
        assert self.reader is not None, "the writer does not read"
        parts = []
        while True:
            chunk, last = self._read_chunk(check, timeout, idle)
            parts.append(chunk)
            if last:
                return parts[0] if len(parts) == 1 else b"".join(parts)

    def _read_chunk(self, check, timeout, idle=None) -> tuple[bytes, bool]:
        h = self.handle
        slot = self._index % h.num_slots
        meta = slot * self._meta_stride
        flag = meta + 1 + self.reader
        buf = self._buf
        tag = self._lap_tag()
        wait_until(lambda: buf[meta] == tag, check, timeout, "a message from the ring's writer", idle)
        start = self._data_offset + slot * h.slot_bytes
        length, last = _CHUNK_HEADER.unpack_from(buf, start)
        body = start + _CHUNK_HEADER.size
        data = bytes(buf[body:body + length])
        buf[flag] = 1
        self._index += 1
        return data, bool(last)
