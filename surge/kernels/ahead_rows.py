"""Rows scheduled ahead of their verdict (speculative decoding under async scheduling), corrected in one launch:
each such request's 1 + k input tokens come from what the step before left on the device, and it starts the drafts
that step rejected earlier than the host counted, so its positions, slots (per KV cache group) and length move
back by that many. As torch ops this was ~18 small launches per step (index_select / index_copy per buffer); with
this kernel the inputs' preparation of a batch-1 verification step went from 0.44 to 0.30 ms of host time (H200).

Per request, meta holds: its index in the step, its row in the device's tokens, and its first token's index.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

META_COLUMNS = 3


# Nothing specialized on its arguments' values or alignment (meta is a view into the step's staged inputs, at any
# offset): the warm-up's one variant is every launch's.
@triton.jit(do_not_specialize=list(range(12)))
def _ahead_rows_kernel(meta_ptr, ahead_ptr, rejected_ptr, input_ids_ptr, positions_ptr, seq_lens_ptr,
                       slots0_ptr, table0_ptr, stride_table0, slots1_ptr, table1_ptr, stride_table1,
                       WIDTH: tl.constexpr, WIDTH_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                       NUM_GROUPS: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    req = tl.load(meta_ptr + r * 3).to(tl.int64)
    row = tl.load(meta_ptr + r * 3 + 1).to(tl.int64)
    first = tl.load(meta_ptr + r * 3 + 2).to(tl.int64)
    rejected = tl.load(rejected_ptr + row).to(tl.int64)
    c = tl.arange(0, WIDTH_PAD)
    m = c < WIDTH
    tok = first + c
    tl.store(input_ids_ptr + tok, tl.load(ahead_ptr + row * WIDTH + c, mask=m), mask=m)
    pos = tl.load(positions_ptr + tok, mask=m, other=0) - rejected
    tl.store(positions_ptr + tok, pos, mask=m)
    block = tl.load(table0_ptr + req * stride_table0 + pos // BLOCK_SIZE, mask=m, other=0).to(tl.int64)
    tl.store(slots0_ptr + tok, block * BLOCK_SIZE + pos % BLOCK_SIZE, mask=m)
    if NUM_GROUPS == 2:
        block = tl.load(table1_ptr + req * stride_table1 + pos // BLOCK_SIZE, mask=m, other=0).to(tl.int64)
        tl.store(slots1_ptr + tok, block * BLOCK_SIZE + pos % BLOCK_SIZE, mask=m)
    length = tl.load(seq_lens_ptr + req)
    tl.store(seq_lens_ptr + req, (length - rejected).to(length.dtype))


def correct_ahead_rows(meta: torch.Tensor, ahead_tokens: torch.Tensor, rejected: torch.Tensor,
                       input_ids: torch.Tensor, positions: torch.Tensor, seq_lens: torch.Tensor,
                       slot_mappings: list[torch.Tensor], block_tables: list[torch.Tensor], block_size: int) -> None:
    """In place, for each request in meta ([n, 3] int64, META_COLUMNS): input_ids of its 1 + k tokens from
    ahead_tokens [rows, 1 + k] (contiguous), their positions less rejected[row], their slots in each of one or two
    KV cache groups from the group's block table, its seq_len less rejected[row]."""
    assert 1 <= len(slot_mappings) == len(block_tables) <= 2 and ahead_tokens.is_contiguous()
    n, width = meta.shape[0], ahead_tokens.shape[1]
    if not n:
        return
    _ahead_rows_kernel[(n,)](meta, ahead_tokens, rejected, input_ids, positions, seq_lens,
                             *_groups(slot_mappings, block_tables), **_launch(width, len(slot_mappings), block_size))


def warm_up_ahead_rows(k: int, input_ids: torch.Tensor, positions: torch.Tensor, seq_lens: torch.Tensor,
                       slot_mappings: list[torch.Tensor], block_tables: list[torch.Tensor], block_size: int) -> None:
    """Compile correct_ahead_rows' variant for 1 + k tokens per row into these buffers, without launching it:
    warm-up may run beside serving."""
    scratch = torch.zeros(1, 1 + k, dtype=torch.int64, device=input_ids.device)
    _ahead_rows_kernel.warmup(scratch, scratch, scratch, input_ids, positions, seq_lens,
                              *_groups(slot_mappings, block_tables), grid=(1,),
                              **_launch(1 + k, len(slot_mappings), block_size))


def _groups(slot_mappings: list[torch.Tensor], block_tables: list[torch.Tensor]) -> tuple:
    """The kernel's group arguments: the second group's are the first's again when there is one."""
    second = 1 if len(slot_mappings) == 2 else 0
    return (slot_mappings[0], block_tables[0], block_tables[0].stride(0), slot_mappings[second],
            block_tables[second], block_tables[second].stride(0))


def _launch(width: int, num_groups: int, block_size: int) -> dict:
    return dict(WIDTH=width, WIDTH_PAD=triton.next_power_of_2(width), BLOCK_SIZE=block_size,
                NUM_GROUPS=num_groups, num_warps=1)
