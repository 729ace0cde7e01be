"""Prefix hashing: a full block's hash chains its parent's hash, its token ids and optional extra keys.

SHA-256 over a fixed byte layout, so hashes are stable across processes and collisions are not a concern.
"""
from __future__ import annotations

import hashlib
from array import array

_ROOT = b"surge-prefix-v1"


def hash_block_tokens(parent_hash: bytes | None, token_ids: list[int], extra_keys: tuple = ()) -> bytes:
    h = hashlib.sha256(parent_hash if parent_hash is not None else _ROOT)
    h.update(array("q", token_ids).tobytes())
    for key in extra_keys:  # the LoRA adapter, the images of the block
        h.update(repr(key).encode())
    return h.digest()
