"""Paged attention through Surge's Triton kernels: the CUDA default (and, under TRITON_INTERPRET=1, testable on CPU).

Kernel modules are imported on first use, so importing this module neither imports nor decorates Triton kernels.
"""
from __future__ import annotations

import torch

from surge.attention.backend import AttentionBackend, AttentionMetadata, AttentionParams, register_backend
from surge.kernels.reference import FP8_KV_DTYPE


# Triton's interpreter runs on the CPU; the split policy then assumes a GPU of this many SMs (an H100/H200).
_CPU_NUM_SMS = 132


@register_backend
class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graphs = True

    def __init__(self) -> None:
        self._kernels: dict[torch.device, object] = {}
        self._mla_kernels: dict[torch.device, object] = {}
        self._v4_kernels: dict[torch.device, object] = {}

    def kernel(self, device: torch.device):
        """The device's PagedAttention wrapper: `dispatch` gives warm-up keys, `compile_many` compiles them."""
        if device not in self._kernels:
            from surge.kernels.attention import PagedAttention

            self._kernels[device] = PagedAttention(device, _num_sms(device))
        return self._kernels[device]

    def mla_kernel(self, device: torch.device):
        """The device's MLAPagedAttention wrapper (multi-head latent attention over the latent cache)."""
        if device not in self._mla_kernels:
            from surge.kernels.mla_attention import MLAPagedAttention

            self._mla_kernels[device] = MLAPagedAttention(device, _num_sms(device))
        return self._mla_kernels[device]

    def deepseek_v4_kernels(self, device: torch.device):
        """The device's DeepSeek V4 kernels (compressor, indexer, sparse attention, mHC): its batched path. One set
        for 'cuda' and 'cuda:N' of the current device (the runner's warm-up names the first, the tensors the second),
        so the launches find the warm-up's keys."""
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device not in self._v4_kernels:
            from surge.attention.deepseek_v4_triton import DeepseekV4Kernels

            self._v4_kernels[device] = DeepseekV4Kernels.on(device)
        return self._v4_kernels[device]

    def supports_cuda_graphs_for(self, layers: tuple[AttentionParams, ...]) -> bool:
        """Every path reads lengths on the device, MLA's included, and DeepSeek V4's batched one (device_path); other
        host-path layers do not."""
        return not any(p.host_path and not p.device_path for p in layers)

    def warm_up(self, device: torch.device, layers: tuple[AttentionParams, ...], block_size: int, dtype: torch.dtype,
                decode_sizes: list[int], max_num_seqs: int, max_workers: int,
                kv_cache_dtype: torch.dtype | None = None) -> int:
        """Every attention variant the runtime will dispatch (each decode capture size and the mixed launch, per
        distinct layer), compiled before serving, so no request or graph capture waits for the compiler."""
        if device.type != "cuda":
            return 0
        kernel, mla_kernel = self.kernel(device), self.mla_kernel(device)
        plain = tuple(p for p in layers if not p.torch_path)
        mla = tuple(p for p in layers if p.is_mla and not p.host_path)  # host-path layers compile nothing here
        keys = warm_up_keys(kernel, plain, block_size, dtype, decode_sizes, max_num_seqs, kv_cache_dtype)
        mla_keys = mla_warm_up_keys(mla_kernel, mla, block_size, dtype, decode_sizes, max_num_seqs)
        return (kernel.compile_many(keys, max_workers=max_workers)
                + mla_kernel.compile_many(mla_keys, max_workers=max_workers))

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata, params: AttentionParams, prologue=None,
                sinks=None, k_scale=None, v_scale=None):
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        slots = meta.slot_mapping
        if prologue is None:
            from surge.kernels.kv_cache import write_kv_cache
            write_kv_cache(k, v, k_cache, v_cache, slots, k_scale, v_scale)
        else:  # norm + rotary + cache write in one launch
            from surge.kernels.rotary import rotary_write_kv
            rotary_write_kv(prologue.positions, q, k, v, prologue.cos_cache, prologue.sin_cache, k_cache, v_cache,
                            slots, prologue.q_norm_weight, prologue.k_norm_weight, prologue.norm_eps,
                            prologue.interleaved, k_scale, v_scale)
        # A one-token row is causal either way: a chunk never ends inside an image, so its token ends any span.
        causal_end = meta.causal_end if params.bidirectional_spans and not meta.decode_only else None
        return self.kernel(q.device)(
            q, k_cache, v_cache, meta.block_table, meta.seq_lens_t, meta.query_start_loc_t,
            num_seqs=meta.num_reqs, decode_only=meta.decode_only, sliding_window=params.sliding_window,
            scale=params.scale, logit_softcap=params.logit_softcap, sinks=sinks, k_scale=k_scale, v_scale=v_scale,
            causal_end=causal_end)

    def forward_mla(self, q, kv_c, k_pe, kv_cache, meta: AttentionMetadata, params: AttentionParams, kv_b_weight):
        from surge.attention.mla import mla_forward_triton
        return mla_forward_triton(q, kv_c, k_pe, kv_cache, meta, params, kv_b_weight, self.mla_kernel(q.device))


def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else _CPU_NUM_SMS


def warm_up_keys(kernel, layers: tuple[AttentionParams, ...], block_size: int, dtype: torch.dtype,
                 decode_sizes: list[int], max_num_seqs: int, kv_cache_dtype: torch.dtype | None = None) -> list:
    """The launch keys of every attention variant the runtime dispatches: per distinct layer, the few-token and the
    general mixed launch (and for bidirectional spans both again with them, for steps that compute images) and each
    decode capture size (repeats collapse in the kernel's cache); kv_cache_dtype: the cache's (None: dtype)."""
    from surge.kernels.attention import FEW_TOKENS

    return [kernel.dispatch(decode_only=decode, num_seqs=n, num_q_heads=p.num_heads, num_kv_heads=p.num_kv_heads,
                            head_dim=p.head_dim, block_size=block_size, dtype=dtype,
                            sliding=p.sliding_window is not None, softcap=p.logit_softcap is not None,
                            sinks=p.has_sinks, num_tokens=t, fp8_kv=kv_cache_dtype == FP8_KV_DTYPE, spans=spans)
            for p in layers
            for decode, n, t, spans in [(False, max_num_seqs, t, s) for t in (FEW_TOKENS, None)
                                        for s in dict.fromkeys((False, p.bidirectional_spans))]
            + [(True, n, None, False) for n in decode_sizes]]


def mla_warm_up_keys(kernel, layers: tuple[AttentionParams, ...], block_size: int, dtype: torch.dtype,
                     decode_sizes: list[int], max_num_seqs: int) -> list:
    """The MLA kernel's launch keys, as warm_up_keys gives the paged kernel's: per distinct MLA layer, the few-token
    and the general mixed launch and each decode capture size."""
    from surge.kernels.attention import FEW_TOKENS

    return [kernel.dispatch(decode_only=decode, num_seqs=n, num_heads=p.num_heads, kv_lora_rank=p.kv_lora_rank,
                            qk_rope_head_dim=p.qk_rope_head_dim, block_size=block_size, dtype=dtype, num_tokens=t)
            for p in layers
            for decode, n, t in [(False, max_num_seqs, FEW_TOKENS), (False, max_num_seqs, None)]
            + [(True, n, None) for n in decode_sizes]]
