"""The daemon's socket, driven by raw clients: garbage, oversized and unknown frames get an error reply and the
daemon keeps serving; the peer's uid is checked; the directory is 0700 and the socket 0600; the lock file stops a
second daemon; a stale socket is replaced, anything else at its path is refused."""
from __future__ import annotations

import os
import socket
import stat
import struct

import msgspec
import pytest
import torch

from surge.engine.args import EngineArgs
from surge.weight_cache.daemon import WeightCacheDaemon
from surge.weight_cache.protocol import (PROTOCOL_VERSION, DaemonClient, ErrorReply, GetMemory, GetState, Health,
                                         HealthReply, MemoryReply, StateReply, decode_reply, recv_frame)
from surge.weight_cache.socket_dir import (DaemonLock, LockHeldError, UnsafePathError, bind_socket, check_private_dir,
                                           ensure_private_dir, lock_holder)
from weight_cache_daemons import running_daemon


def _raw(path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(str(path))
    return sock


def _reply(sock: socket.socket):
    return decode_reply(recv_frame(sock, 1 << 20))


def _framed(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


def _healthy(daemon) -> bool:
    with DaemonClient(daemon.socket_path, 10) as client:
        reply = client.request(Health())
    return isinstance(reply, HealthReply) and reply.state == "ready"


def test_bad_frames_leave_the_daemon_serving(daemon):
    with _raw(daemon.socket_path) as sock:  # framed garbage: an error reply, and the connection stays usable
        for body, code in [(b"\xc1\xc1 not msgpack", "bad_frame"),
                           (msgspec.msgpack.encode({"cmd": "shutdown", "version": PROTOCOL_VERSION}),
                            "unknown_command"),
                           (msgspec.msgpack.encode({"cmd": "health", "version": 99}), "protocol_version"),
                           (msgspec.msgpack.encode({"cmd": "get_state", "version": PROTOCOL_VERSION, "key": 7}),
                            "bad_frame")]:
            sock.sendall(_framed(body))
            reply = _reply(sock)
            assert isinstance(reply, ErrorReply) and reply.code == code, reply
        sock.sendall(_framed(msgspec.msgpack.encode(Health())))
        assert isinstance(_reply(sock), HealthReply)
    with _raw(daemon.socket_path) as sock:  # an oversized frame: an error reply, then the stream is closed
        sock.sendall(struct.pack(">I", 1 << 30))
        reply = _reply(sock)
        assert reply.code == "frame_too_large" and "exceeds the limit" in reply.message
        assert sock.recv(1) == b""
    with _raw(daemon.socket_path) as sock:  # not our protocol at all (its first bytes read as a huge length)
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _reply(sock).code == "frame_too_large"
    for _ in range(3):  # half a header, then gone; connect and close at once
        with _raw(daemon.socket_path) as sock:
            sock.sendall(b"\x00\x00")
    assert _healthy(daemon)


def test_memory_and_health(daemon):
    with DaemonClient(daemon.socket_path, 10) as client:
        memory = client.request(GetMemory())
        health = client.request(Health())
    assert isinstance(memory, MemoryReply) and memory.state == "ready" and memory.device == "cpu"
    model_bytes = sum(p.numel() * p.element_size() for p in daemon.model.parameters())
    buffer_bytes = sum(b.numel() * b.element_size() for b in daemon.model.buffers())
    assert memory.device_bytes == model_bytes + buffer_bytes  # tied weights and shared buffers counted once
    assert memory.num_tensors == len(daemon.table.tensors) and memory.num_storages == len(daemon.table.storages)
    assert health.pid == os.getpid() and health.key == daemon.key and health.device_bytes == memory.device_bytes


def test_key_mismatch_reply_names_the_fields(daemon):
    key = msgspec.structs.replace(daemon.key, dtype="bfloat16", tensor_parallel_rank=1)
    with DaemonClient(daemon.socket_path, 10) as client:
        reply = client.request(GetState(key=key))
        assert isinstance(reply, ErrorReply) and reply.code == "key_mismatch"
        assert reply.fields == ["dtype", "tensor_parallel_rank"]
        assert "dtype (daemon 'float32', engine 'bfloat16')" in reply.message
        assert isinstance(client.request(GetState(key=daemon.key)), StateReply)  # no descriptors read: fine


def test_peer_of_another_user_is_refused(daemon, monkeypatch):
    import surge.weight_cache.daemon as daemon_module
    real = os.getuid()
    monkeypatch.setattr(daemon_module.os, "getuid", lambda: real + 1)  # as if the client were someone else
    with _raw(daemon.socket_path) as sock:  # the daemon answers at once and hangs up
        reply = _reply(sock)
    monkeypatch.undo()
    assert isinstance(reply, ErrorReply) and reply.code == "forbidden"
    assert _healthy(daemon)


def test_directory_and_socket_are_private(daemon):
    assert stat.S_IMODE(os.stat(daemon.socket_dir).st_mode) == 0o700
    assert stat.S_IMODE(os.lstat(daemon.socket_path).st_mode) == 0o600
    assert stat.S_ISSOCK(os.lstat(daemon.socket_path).st_mode)
    assert stat.S_IMODE(os.lstat(daemon.lock.path).st_mode) == 0o600
    assert lock_holder(daemon.lock.path) == os.getpid()


def test_directory_rules(tmp_path):
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    os.chmod(loose, 0o755)
    with pytest.raises(UnsafePathError, match="open to other users"):
        check_private_dir(loose)  # an engine does not trust it
    assert stat.S_IMODE(os.stat(ensure_private_dir(loose)).st_mode) == 0o700  # a daemon tightens its own
    link = tmp_path / "link"
    link.symlink_to(loose)
    with pytest.raises(UnsafePathError, match="symlink"):
        ensure_private_dir(link)


def test_lock_file_stops_a_second_daemon(tied_dir, tmp_path):
    with running_daemon(tied_dir, tmp_path / "s") as first:
        config = EngineArgs(tied_dir, device="cpu", max_model_len=128).create_engine_config()
        second = WeightCacheDaemon(config, 0, torch.device("cpu"), tmp_path / "s")
        with pytest.raises(LockHeldError, match=rf"another weight-cache daemon \(pid {os.getpid()}\) holds"):
            second.acquire()
        second.close()  # must not remove the first one's socket
        assert _healthy(first)
    assert not first.socket_path.exists() and not first.lock.path.exists()
    lock = DaemonLock(first.lock.path)  # free again once the owner is gone
    lock.acquire()
    lock.release()


def test_stale_socket_is_replaced_and_other_files_refused(tmp_path):
    path = ensure_private_dir(tmp_path / "s") / "rank-0.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))
    stale.close()  # the file stays behind, as after a crash
    with pytest.raises(ConnectionRefusedError):
        _raw(path)
    listener = bind_socket(path)
    with listener, _raw(path):
        assert stat.S_IMODE(os.lstat(path).st_mode) == 0o600
    os.unlink(path)
    path.write_text("not a socket")
    with pytest.raises(UnsafePathError, match="not a socket of ours"):
        bind_socket(path)
    assert path.read_text() == "not a socket"
