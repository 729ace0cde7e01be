"""Structured output's mask on the logits: rows of packed int32 words, bit t % 32 of word t // 32 allowing token t.
Disallowed tokens become -inf in place, before sampling, so greedy, top-k/top-p and logprobs all see the mask.

A few elementwise torch ops: at batch 64 and a 152k vocabulary they touch ~40 MB, microseconds on a GPU, so a
dedicated kernel would buy nothing measurable."""
from __future__ import annotations

import numpy as np
import torch

_BITS = {}  # device -> the eight bit values of a byte, 1 to 128, as uint8


def bitmask_to_device(buffer, num_rows: int, num_words: int, device: torch.device) -> torch.Tensor:
    """A mask as the step carries it (bytes-like: num_rows x num_words little-endian int32 words) as a [num_rows,
    num_words] int32 tensor on device. A writable buffer is read in place: the engine's own, pinned when the runner
    is on CUDA, so the upload is one asynchronous copy (the engine does not refill it before the step has run). A
    read-only one (bytes decoded from a step message) is first copied once into pinned memory from torch's caching
    allocator, which keeps that block until the copy has run."""
    words = np.frombuffer(buffer, dtype="<i4", count=num_rows * num_words).reshape(num_rows, num_words)
    if words.flags.writeable:
        host = torch.from_numpy(words)
    else:
        host = torch.empty((num_rows, num_words), dtype=torch.int32, pin_memory=device.type == "cuda")
        host.numpy()[...] = words
    return host if device.type == "cpu" else host.to(device, non_blocking=True)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int, use_numpy: bool | None = None) -> torch.Tensor:
    """[n, W] int32 words -> [n, vocab_size] bool, True where allowed (tokens past 32 * W are not). use_numpy (None:
    on the CPU) unpacks with numpy's unpackbits, one pass and twice as fast there as the torch ops."""
    return _unpack(bitmask, vocab_size, use_numpy, allowed=True)


def _unpack(bitmask: torch.Tensor, vocab_size: int, use_numpy: bool | None, allowed: bool) -> torch.Tensor:
    """True where the token is allowed (allowed=True) or where it is not (allowed=False): the torch path computes
    either in the same two elementwise ops, so applying a mask needs no separate negation."""
    n, words = bitmask.shape
    # Bytes of the little-endian words, low bit first: token t is bit t % 8 of byte t // 8.
    as_bytes = bitmask.contiguous().view(torch.uint8)
    if use_numpy if use_numpy is not None else bitmask.device.type == "cpu":
        bits = torch.from_numpy(np.unpackbits(as_bytes.numpy(), axis=1, bitorder="little")).view(torch.bool)
        if not allowed:
            bits = ~bits
    else:
        weights = _BITS.get(bitmask.device)
        if weights is None:
            weights = _BITS[bitmask.device] = torch.tensor([1 << b for b in range(8)], dtype=torch.uint8,
                                                           device=bitmask.device)
        set_bits = as_bytes[:, :, None] & weights
        bits = (set_bits != 0 if allowed else set_bits == 0).view(n, words * 32)
    if words * 32 >= vocab_size:
        return bits[:, :vocab_size]
    return torch.nn.functional.pad(bits, (0, vocab_size - words * 32), value=not allowed)


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """In place: logits[rows[i], t] = -inf where bitmask[i] does not allow t; rows None: row i of logits is row i of
    the mask. logits [N, V] of any float dtype; bitmask [n, W] int32 on logits' device; rows [n] int64."""
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2:
        raise ValueError(f"bitmask must be a 2-D int32 tensor, got {bitmask.dtype} of shape {tuple(bitmask.shape)}")
    disallowed = _unpack(bitmask, logits.shape[1], None, allowed=False)
    if rows is None:
        logits.masked_fill_(disallowed, float("-inf"))
    else:
        logits[rows] = logits[rows].masked_fill_(disallowed, float("-inf"))
