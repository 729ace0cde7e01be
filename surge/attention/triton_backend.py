"""Paged attention through Surge's Triton kernels: the CUDA default (and, under TRITON_INTERPRET=1, testable on CPU).

Kernel modules are imported on first use, so importing this module neither imports nor decorates Triton kernels.
"""
from __future__ import annotations

import torch

from surge.attention.backend import AttentionBackend, AttentionMetadata, register_backend

# Triton's interpreter runs on the CPU; the split policy then assumes a GPU of this many SMs (an H100/H200).
_CPU_NUM_SMS = 132


@register_backend
class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    def __init__(self) -> None:
        self._kernels: dict[torch.device, object] = {}

    def kernel(self, device: torch.device):
        """The device's PagedAttention wrapper: `dispatch` gives warm-up keys, `compile_many` compiles them."""
        if device not in self._kernels:
            from surge.kernels.attention import PagedAttention

            num_sms = (torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda"
                       else _CPU_NUM_SMS)
            self._kernels[device] = PagedAttention(device, num_sms)
        return self._kernels[device]

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata, group_id, sliding_window, scale, prologue=None):
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        slots = meta.slot_mapping[group_id]
        if prologue is None:
            from surge.kernels.kv_cache import write_kv_cache
            write_kv_cache(k, v, k_cache, v_cache, slots)
        else:  # norm + rotary + cache write in one launch
            from surge.kernels.rotary import rotary_write_kv
            qn, kn = prologue.q_norm, prologue.k_norm
            rotary_write_kv(prologue.positions, q, k, v, prologue.rotary.cos_cache, prologue.rotary.sin_cache,
                            k_cache, v_cache, slots, qn.weight if qn is not None else None,
                            kn.weight if kn is not None else None, qn.eps if qn is not None else 0.0)
        return self.kernel(q.device)(
            q, k_cache, v_cache, meta.block_tables[group_id], meta.seq_lens_t, meta.query_start_loc_t,
            num_seqs=meta.num_reqs, decode_only=meta.max_query_len == 1, sliding_window=sliding_window,
            scale=scale)
