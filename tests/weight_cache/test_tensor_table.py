"""The CUDA leg of the storage contract, without a GPU: a daemon's `_share_cuda_` export reaches the engine's
`_new_shared_cuda` field for field, in torch's order (as torch.multiprocessing.reductions does it), opened on the
engine's own device index, whatever index the daemon's process used."""
from __future__ import annotations

import torch

from surge.weight_cache.protocol import StateReply, decode_reply, encode_frame
from surge.weight_cache.tensor_table import TensorTable, export_handles, open_storages


class FakeCudaStorage:
    device = torch.device("cuda", 5)  # the daemon's index

    def __init__(self, nbytes: int, offset: int) -> None:
        self._nbytes, self.offset = nbytes, offset

    def nbytes(self) -> int:
        return self._nbytes

    def _share_cuda_(self):
        # (device, handle, storage bytes, offset in the allocation, ref counter handle, its offset, event, sync)
        return (5, b"H" * 64, self._nbytes, self.offset, b"/torch_ref", 9, b"E" * 64, True)


def test_cuda_export_reaches_new_shared_cuda_unchanged(monkeypatch):
    table = TensorTable(storages=[FakeCudaStorage(1024, 0), FakeCudaStorage(256, 2048)], tensors=[], aliases=[])
    handles, fds = export_handles(table)
    assert fds == []
    reply = decode_reply(encode_frame(StateReply(device_kind="cuda", storages=handles, tensors=[], aliases=[],
                                                 num_fds=0))[4:])
    calls = []
    monkeypatch.setattr(torch.cuda, "_lazy_init", lambda: None)
    monkeypatch.setattr(torch.UntypedStorage, "_new_shared_cuda",
                        classmethod(lambda cls, *args: calls.append(args) or torch.UntypedStorage(args[2])))
    storages = open_storages(reply.storages, [], torch.device("cuda", 1))  # the engine's index for that GPU
    assert [s.nbytes() for s in storages] == [1024, 256]
    assert calls == [(1, b"H" * 64, 1024, 0, b"/torch_ref", 9, b"E" * 64, True),
                     (1, b"H" * 64, 256, 2048, b"/torch_ref", 9, b"E" * 64, True)]
