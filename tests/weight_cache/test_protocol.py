"""The wire format and the key: every command round-trips as msgpack (never pickle), malformed frames become precise
protocol errors, oversized frames are refused before their body is read, descriptors cross in batches, and both
sides compute the same WeightCacheKey, which changes with anything that changes the weights."""
from __future__ import annotations

import os
import socket
import struct

import msgspec
import pytest
import torch

from surge.engine.args import EngineArgs
from surge.weight_cache.key import socket_name, weight_cache_key
from surge.weight_cache.protocol import (FD_BATCH, MAX_REQUEST_BYTES, PROTOCOL_VERSION, CudaIpcHandle, GetMemory,
                                         GetState, Health, ProtocolError, Release, StateReply, StorageHandle,
                                         TensorEntry, decode_reply, decode_request, describe_key_mismatch,
                                         encode_frame, key_differences, recv_fds, recv_frame, send_fds)


def _key(model_dir, rank: int = 0, **engine):
    config = EngineArgs(model_dir, **{"device": "cpu", "max_model_len": 128, **engine}).create_engine_config()
    return weight_cache_key(config.model_config, config.parallel_config, rank, config.device)


def test_every_command_round_trips(llama_dir):
    key = _key(llama_dir)
    for request in (GetState(key=key, mode="copy"), Release(key=key), GetMemory(), Health()):
        frame = encode_frame(request)
        (size,) = struct.unpack(">I", frame[:4])
        assert size == len(frame) - 4
        assert decode_request(frame[4:]) == request
        assert isinstance(msgspec.msgpack.decode(frame[4:]), dict)  # plain msgpack: any language can read it


def test_cuda_handles_round_trip_as_bytes():
    """What a CUDA daemon sends (torch's _share_cuda_ export): raw handle bytes, and no event when none is needed."""
    storages = [StorageHandle(nbytes=4096, cuda=CudaIpcHandle(handle=bytes(range(64)), offset_bytes=512,
                                                              ref_counter_handle=b"/torch_123_456_0",
                                                              ref_counter_offset=7, event_handle=b"\x01" * 64,
                                                              event_sync_required=True)),
                StorageHandle(nbytes=2, cuda=CudaIpcHandle(handle=b"\x00" * 64, offset_bytes=0, ref_counter_handle=b"r",
                                                           ref_counter_offset=0, event_handle=None,
                                                           event_sync_required=False))]
    reply = StateReply(device_kind="cuda", storages=storages, num_fds=0, aliases=[("lm_head.weight", "embed.weight")],
                       tensors=[TensorEntry(name="embed.weight", kind="parameter", dtype="bfloat16", shape=[4, 512],
                                            stride=[512, 1], storage=0, storage_offset=0)])
    assert decode_reply(encode_frame(reply)[4:]) == reply


@pytest.mark.parametrize("body, code", [
    (b"\x00garbage\xff", "bad_frame"),
    (msgspec.msgpack.encode([1, 2, 3]), "bad_frame"),
    (msgspec.msgpack.encode({"cmd": "format_disk", "version": PROTOCOL_VERSION}), "unknown_command"),
    (msgspec.msgpack.encode({"cmd": "health", "version": PROTOCOL_VERSION + 1}), "protocol_version"),
    (msgspec.msgpack.encode({"cmd": "get_state", "version": PROTOCOL_VERSION}), "bad_frame"),  # no key
    (msgspec.msgpack.encode({"cmd": "get_state", "version": PROTOCOL_VERSION, "key": {"dtype": 3}}), "bad_frame"),
])
def test_malformed_requests_are_protocol_errors(body, code):
    with pytest.raises(ProtocolError) as e:
        decode_request(body)
    assert e.value.code == code


def test_oversized_frame_refused_before_its_body():
    a, b = socket.socketpair()
    with a, b:
        a.sendall(struct.pack(">I", MAX_REQUEST_BYTES + 1))  # no body follows: reading it would hang
        b.settimeout(5)
        with pytest.raises(ProtocolError, match="exceeds the limit") as e:
            recv_frame(b, MAX_REQUEST_BYTES)
        assert e.value.code == "frame_too_large"


def test_descriptors_cross_in_batches(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"x")
    count = 2 * FD_BATCH + 3
    fds = [os.open(path, os.O_RDONLY) for _ in range(count)]
    a, b = socket.socketpair()
    try:
        send_fds(a, fds)
        got = recv_fds(b, count)
        assert len(got) == count
        assert {os.fstat(fd).st_ino for fd in got} == {path.stat().st_ino}
        for fd in got:
            os.close(fd)
    finally:
        for fd in fds:
            os.close(fd)
        a.close()
        b.close()


def test_both_sides_compute_the_same_key_and_it_tracks_the_weights(llama_dir):
    key = _key(llama_dir)
    assert _key(llama_dir) == key
    assert key_differences(key, _key(llama_dir, dtype="bfloat16")) == ["dtype"]
    assert key_differences(key, _key(llama_dir, max_model_len=64)) == ["max_model_len"]
    assert key_differences(key, _key(llama_dir, rank=1, tensor_parallel_size=2)) == ["tensor_parallel_size",
                                                                                     "tensor_parallel_rank"]
    tp2 = _key(llama_dir, rank=1, tensor_parallel_size=2)  # an expert shard is not the tensor-parallel one
    assert key_differences(tp2, _key(llama_dir, rank=1, tensor_parallel_size=2, enable_expert_parallel=True)) == [
        "expert_parallel_size"]
    message = describe_key_mismatch(key, _key(llama_dir, dtype="bfloat16"))
    assert message == "key mismatch: dtype (daemon 'float32', engine 'bfloat16')"
    shard = next(llama_dir.glob("*.safetensors"))
    stat = shard.stat()
    try:
        os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # a rewritten checkpoint
        assert key_differences(key, _key(llama_dir)) == ["checkpoint"]
    finally:
        os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert _key(llama_dir) == key


def test_cpu_sockets_are_named_by_rank():
    assert socket_name(torch.device("cpu"), 5) == "rank-5.sock"


def test_unknown_engine_options_are_refused(llama_dir):
    with pytest.raises(ValueError, match="weight_cache_mode='fast' is not supported"):
        EngineArgs(llama_dir, device="cpu", weight_cache_mode="fast").create_engine_config()
    with pytest.raises(ValueError, match="has no checkpoint for load_format='weight_cache'"):
        EngineArgs(preset="tiny-llama", device="cpu", load_format="weight_cache").create_engine_config()
    with pytest.raises(ValueError, match="weight_cache_timeout=0"):
        EngineArgs(llama_dir, device="cpu", weight_cache_timeout=0).create_engine_config()
