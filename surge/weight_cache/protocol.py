"""The weight-cache wire format: length-prefixed msgspec (msgpack) frames on a Unix socket, never pickle.

A frame is a 4-byte big-endian length and a msgpack body: at most MAX_REQUEST_BYTES from an engine, MAX_REPLY_BYTES
from a daemon. Every request carries its command (`cmd`) and the protocol version, and gets exactly one reply. A
StateReply describes the daemon's tensors as views of storages; each storage crosses as a CUDA IPC handle inside the
reply, or (CPU) as a shared-memory file descriptor sent after it with SCM_RIGHTS, FD_BATCH per one-byte message.
"""
from __future__ import annotations

import os
import socket
import struct

import msgspec

PROTOCOL_VERSION = 1
MAX_REQUEST_BYTES = 1 << 20
MAX_REPLY_BYTES = 256 << 20
FD_BATCH = 128  # descriptors per SCM_RIGHTS message (the kernel takes at most 253)
_LENGTH = struct.Struct(">I")


class WeightCacheKey(msgspec.Struct, frozen=True, kw_only=True):
    """What a daemon's weights must match to serve an engine rank; weight_cache.key computes it on both sides."""
    protocol_version: int
    surge_version: str
    torch_version: str
    checkpoint: str  # sha256 of shard names, sizes, mtimes and safetensors headers (never the weight bytes)
    model_config: str  # sha256 of the model's config (config.json and what Surge derives from it)
    architecture: str
    dtype: str
    quantization: str
    max_model_len: int  # sizes the rotary tables, which travel with the weights
    tensor_parallel_size: int
    tensor_parallel_rank: int
    expert_parallel_size: int = 1  # ranks the experts are split over: a rank's expert shard differs from its TP one
    pipeline_parallel_size: int
    pipeline_parallel_rank: int
    device_kind: str  # "cpu" or "cuda"
    device_uuid: str  # the GPU's UUID; "cpu" on CPU
    device_arch: str  # "sm_90" ...; the machine type on CPU


def key_differences(daemon: WeightCacheKey, engine: WeightCacheKey) -> list[str]:
    return [f for f in daemon.__struct_fields__ if getattr(daemon, f) != getattr(engine, f)]


def describe_key_mismatch(daemon: WeightCacheKey, engine: WeightCacheKey) -> str:
    return "key mismatch: " + "; ".join(f"{f} (daemon {getattr(daemon, f)!r}, engine {getattr(engine, f)!r})"
                                        for f in key_differences(daemon, engine))


# ---- requests (engine -> daemon) ----

class Envelope(msgspec.Struct):
    """Read before anything else, so a frame of another version or command gets a precise error."""
    cmd: str
    version: int


class _Request(msgspec.Struct, tag_field="cmd", kw_only=True):
    version: int = PROTOCOL_VERSION


class GetState(_Request, tag="get_state"):
    key: WeightCacheKey
    mode: str = "zero_copy"  # for the daemon's log: a copy-mode engine releases afterwards


class Release(_Request, tag="release"):
    key: WeightCacheKey


class GetMemory(_Request, tag="get_memory"):
    pass


class Health(_Request, tag="health"):
    pass


Request = GetState | Release | GetMemory | Health
COMMANDS = ("get_state", "release", "get_memory", "health")


# ---- replies (daemon -> engine) ----

class CudaIpcHandle(msgspec.Struct, array_like=True):
    """torch's export of one CUDA storage (UntypedStorage._share_cuda_), minus the device index: the engine opens
    it on its own device, whose UUID the key has already matched."""
    handle: bytes  # cudaIpcMemHandle of the allocation holding the storage
    offset_bytes: int  # the storage's offset inside that allocation
    ref_counter_handle: bytes  # the producer's count of live consumers, one reference per export
    ref_counter_offset: int
    event_handle: bytes | None
    event_sync_required: bool


class StorageHandle(msgspec.Struct, array_like=True):
    nbytes: int
    fd_index: int = -1  # CPU: index among the descriptors that follow the reply
    cuda: CudaIpcHandle | None = None


class TensorEntry(msgspec.Struct, array_like=True):
    name: str
    kind: str  # "parameter" or "buffer"
    dtype: str  # torch dtype name without "torch."
    shape: list[int]
    stride: list[int]
    storage: int  # index into StateReply.storages
    storage_offset: int  # in elements


class _Reply(msgspec.Struct, tag_field="reply", kw_only=True):
    pass


class StateReply(_Reply, tag="state"):
    device_kind: str
    storages: list[StorageHandle]
    tensors: list[TensorEntry]
    aliases: list[tuple[str, str]]  # (alias, name of the tensor it is): tied weights, shared rotary tables
    num_fds: int


class MemoryReply(_Reply, tag="memory"):
    state: str  # "ready" or "released"
    device: str
    device_bytes: int  # held by the daemon's weights on its device
    num_tensors: int
    num_storages: int


class HealthReply(_Reply, tag="health"):
    state: str
    pid: int
    key: WeightCacheKey
    load_seconds: float
    device_bytes: int


class ReleaseReply(_Reply, tag="released"):
    freed_bytes: int


class ErrorReply(_Reply, tag="error"):
    code: str  # bad_frame, frame_too_large, protocol_version, unknown_command, key_mismatch, released, busy, ...
    message: str
    fields: list[str] = []  # key_mismatch: the differing key fields


Reply = StateReply | MemoryReply | HealthReply | ReleaseReply | ErrorReply

_encoder = msgspec.msgpack.Encoder()
_envelope_decoder = msgspec.msgpack.Decoder(Envelope)
_request_decoder = msgspec.msgpack.Decoder(Request)
_reply_decoder = msgspec.msgpack.Decoder(Reply)


class ProtocolError(Exception):
    """A frame the other side should not have sent; `code` goes into the ErrorReply."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class ConnectionClosed(ProtocolError):
    def __init__(self, message: str = "the peer closed the connection") -> None:
        super().__init__("closed", message)


def decode_request(data: bytes) -> Request:
    try:
        envelope = _envelope_decoder.decode(data)
    except msgspec.MsgspecError as e:
        raise ProtocolError("bad_frame", f"not a weight-cache request ({e})") from None
    if envelope.version != PROTOCOL_VERSION:
        raise ProtocolError("protocol_version", f"protocol version {envelope.version} is not supported; this daemon "
                            f"speaks version {PROTOCOL_VERSION}")
    if envelope.cmd not in COMMANDS:
        raise ProtocolError("unknown_command", f"unknown command {envelope.cmd[:64]!r}; known: {', '.join(COMMANDS)}")
    try:
        return _request_decoder.decode(data)
    except msgspec.MsgspecError as e:
        raise ProtocolError("bad_frame", f"malformed {envelope.cmd} request ({e})") from None


def decode_reply(data: bytes) -> Reply:
    try:
        return _reply_decoder.decode(data)
    except msgspec.MsgspecError as e:
        raise ProtocolError("bad_frame", f"not a weight-cache reply ({e})") from None


def encode_frame(msg: msgspec.Struct) -> bytes:
    body = _encoder.encode(msg)
    return _LENGTH.pack(len(body)) + body


def send_frame(sock: socket.socket, msg: msgspec.Struct) -> None:
    sock.sendall(encode_frame(msg))


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionClosed()
        got += k
    return bytes(buf)


def recv_frame(sock: socket.socket, limit: int) -> bytes:
    """One frame's body; ProtocolError("frame_too_large") before reading a body over `limit` bytes (the stream is
    then out of step: the caller closes it)."""
    (size,) = _LENGTH.unpack(_recv_exactly(sock, _LENGTH.size))
    if size > limit:
        raise ProtocolError("frame_too_large", f"a frame of {size} bytes exceeds the limit of {limit} bytes")
    return _recv_exactly(sock, size)


def send_fds(sock: socket.socket, fds: list[int]) -> None:
    for i in range(0, len(fds), FD_BATCH):
        socket.send_fds(sock, [b"F"], fds[i:i + FD_BATCH])


def recv_fds(sock: socket.socket, count: int) -> list[int]:
    """Exactly `count` descriptors; the caller owns (closes) them. On any failure those received are closed."""
    fds: list[int] = []
    try:
        while len(fds) < count:
            want = min(FD_BATCH, count - len(fds))
            msg, got, flags, _ = socket.recv_fds(sock, 1, want)
            fds.extend(got)
            if not msg:
                raise ConnectionClosed("the daemon closed the connection while sending descriptors")
            if flags & socket.MSG_CTRUNC:
                raise ProtocolError("fds_truncated", "descriptors were dropped in transit (the engine's open-file "
                                    "limit, RLIMIT_NOFILE, is too low)")
            if len(got) != want:
                raise ProtocolError("fds_missing", f"expected {want} descriptors in a batch, got {len(got)}")
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return fds


class DaemonClient:
    """One connection to a daemon: request -> reply, bounded by `timeout` seconds per operation."""

    def __init__(self, path: str | os.PathLike, timeout: float) -> None:
        self.path = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        try:
            self.sock.connect(self.path)
        except BaseException:
            self.sock.close()
            raise

    def request(self, msg: msgspec.Struct) -> Reply:
        send_frame(self.sock, msg)
        return decode_reply(recv_frame(self.sock, MAX_REPLY_BYTES))

    def recv_fds(self, count: int) -> list[int]:
        return recv_fds(self.sock, count)

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> DaemonClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
