"""BlockPool: the blocks of one KV cache group, with reference counts and a prefix cache of full blocks.

Free blocks sit in an LRU queue; a free block that still holds a cached prefix can be revived by a hit until it is
evicted, oldest first, to serve a new allocation. Block 0 is the null block: a placeholder that is never handed out.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(eq=False)
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None

    @property
    def is_null(self) -> bool:
        return self.block_id == 0


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        assert num_blocks >= 2, "need the null block plus at least one real block"
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.ref_cnt = 1  # never free
        self._free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks[1:])
        self._cached: dict[bytes, Block] = {}
        self.num_queries = 0  # prefix-cache lookups, in blocks
        self.num_hits = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of real blocks held by requests (free cached blocks count as free)."""
        return 1.0 - self.num_free_blocks / (self.num_blocks - 1)

    def get_cached_block(self, block_hash: bytes) -> Block | None:
        return self._cached.get(block_hash)

    def get_new_blocks(self, n: int) -> list[Block]:
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: list[Block]) -> None:
        """Take a reference on blocks found by a prefix-cache hit."""
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: list[Block]) -> None:
        """Drop a reference; the caller passes blocks in eviction order (first evicted first)."""
        for block in blocks:
            if block.is_null:
                continue
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0
            if block.ref_cnt == 0:
                if not self.enable_caching:
                    self._evict(block)
                self._free[block.block_id] = block

    def cache_block(self, block: Block, block_hash: bytes) -> None:
        if not self.enable_caching or block.is_null or block.block_hash is not None:
            return
        if block_hash in self._cached:  # the same content computed twice: keep the first copy
            return
        block.block_hash = block_hash
        self._cached[block_hash] = block

    def reset_prefix_cache(self) -> bool:
        if any(b.ref_cnt for b in self.blocks[1:]):
            return False
        for block in self.blocks[1:]:
            self._evict(block)
        return True

    def _evict(self, block: Block) -> None:
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
            block.block_hash = None
