"""The shared-memory ring: every reader gets every message, in order, whole, however it compares to the slot size;
the writer never overwrites a slot a reader has not read; a failing check ends a wait."""
from __future__ import annotations

import threading

import pytest

from surge.distributed.shm_broadcast import ShmRing


def test_messages_reach_every_reader_in_order():
    ring = ShmRing.create(num_readers=2, slot_bytes=64, num_slots=3)
    readers = [ShmRing.attach(ring.handle, r) for r in range(2)]
    ring.unlink()  # attached: the name may go, the memory stays
    # Empty, smaller than a slot, exactly a slot's payload, and spanning many slots (more than the ring holds).
    messages = [b"", b"x", bytes(range(59)), bytes(i % 251 for i in range(1000))]
    messages += [f"m{i}".encode() for i in range(20)]
    got: list[list[bytes]] = [[], []]

    def read(r: int) -> None:
        for _ in messages:
            got[r].append(readers[r].read(timeout=10))

    threads = [threading.Thread(target=read, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for m in messages:
        ring.write(m, timeout=10)
    for t in threads:
        t.join(10)
    assert got == [messages, messages]
    for r in readers + [ring]:
        r.close()


def test_writer_waits_for_the_slowest_reader():
    ring = ShmRing.create(num_readers=2, slot_bytes=64, num_slots=2)
    fast, slow = ShmRing.attach(ring.handle, 0), ShmRing.attach(ring.handle, 1)
    ring.unlink()
    ring.write(b"a")
    ring.write(b"b")
    assert fast.read(timeout=1) == b"a" and fast.read(timeout=1) == b"b"
    with pytest.raises(TimeoutError):  # slot 0 still holds "a" for the slow reader
        ring.write(b"c", timeout=0.1)
    assert slow.read(timeout=1) == b"a"
    ring.write(b"c", timeout=1)
    assert slow.read(timeout=1) == b"b" and slow.read(timeout=1) == b"c" and fast.read(timeout=1) == b"c"


def test_check_aborts_a_wait():
    ring = ShmRing.create(num_readers=1)
    reader = ShmRing.attach(ring.handle, 0)
    ring.unlink()

    def peer_dead() -> None:
        raise RuntimeError("rank 1 died")

    with pytest.raises(RuntimeError, match="rank 1 died"):
        reader.read(check=peer_dead)
