"""KV cache managers: one per group (full attention, sliding window) and a KVCacheManager coordinating them.

The coordinator finds prefix-cache hits that every group can serve, allocates slots for a step all-or-nothing,
frees a request's blocks (or only its tail, after rejected draft tokens); sliding-window groups hand back blocks
that fell out of the window. Each group remembers from which index a request's block table changed since the step
message last carried it, so the message holds only that part.
"""
from __future__ import annotations

from surge.core.kv_cache.block_pool import Block, BlockPool
from surge.core.kv_cache.spec import KVCacheConfig, KVCacheGroup, SlidingWindowSpec
from surge.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class GroupManager:
    """Blocks of one group: full attention keeps every block of a request."""

    def __init__(self, group: KVCacheGroup, pool: BlockPool) -> None:
        self.group = group
        self.pool = pool
        self.block_size = group.spec.block_size
        self.req_blocks: dict[str, list[Block]] = {}
        self._changed_from: dict[str, int] = {}  # request id -> first index changed since take_changes
        self._num_cached: dict[str, int] = {}  # request id -> leading blocks already offered to the prefix cache

    def _mark_changed(self, request_id: str, index: int) -> None:
        self._changed_from[request_id] = min(self._changed_from.get(request_id, index), index)

    def take_changes(self, request_id: str) -> tuple[int, list[int]]:
        """(first changed index, block ids from there on) since the last call; then nothing is changed."""
        blocks = self.req_blocks.get(request_id, ())
        start = self._changed_from.pop(request_id, None)
        if start is None or start >= len(blocks):  # the common decode step: nothing changed
            return len(blocks), []
        return start, [b.block_id for b in blocks[start:]]

    def find_cache_hit(self, block_hashes: list[bytes], max_blocks: int) -> list[Block]:
        """Longest run of cached blocks from the start."""
        hit = []
        for h in block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(h)
            if block is None:
                break
            hit.append(block)
        return hit

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        pass

    def num_blocks_to_allocate(self, request_id: str, num_tokens: int, hit: list[Block]) -> int:
        """New blocks plus hit blocks that are now free (taking them removes them from the free queue)."""
        have = len(self.req_blocks.get(request_id, ())) or len(hit)
        revived = sum(1 for b in hit if b.ref_cnt == 0 and not b.is_null)
        return max(0, cdiv(num_tokens, self.block_size) - have) + revived

    def allocate(self, request_id: str, num_tokens: int, hit: list[Block]) -> None:
        blocks = self.req_blocks.setdefault(request_id, [])
        if hit and not blocks:
            self._mark_changed(request_id, 0)
            self.pool.touch(hit)
            blocks.extend(hit)
        need = cdiv(num_tokens, self.block_size) - len(blocks)
        if need > 0:
            self._mark_changed(request_id, len(blocks))
            blocks.extend(self.pool.get_new_blocks(need))

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Offer the request's newly completed blocks to the prefix cache (each block once, not every step)."""
        rid = request.request_id
        blocks = self.req_blocks[rid]
        num_full = min(num_tokens // self.block_size, len(request.block_hashes))
        for i in range(self._num_cached.get(rid, 0), num_full):
            self.pool.cache_block(blocks[i], request.block_hashes[i])
        if num_full > self._num_cached.get(rid, 0):
            self._num_cached[rid] = num_full

    def free(self, request_id: str) -> None:
        blocks = self.req_blocks.pop(request_id, [])
        self._changed_from.pop(request_id, None)  # a table allocated again is new from index 0
        self._num_cached.pop(request_id, None)
        self.pool.free_blocks(list(reversed(blocks)))  # the tail is least likely to be shared: evict it first

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Keep the blocks that hold the first num_tokens positions; free the rest (never prefix-cached: they hold
        no complete block of known tokens)."""
        blocks = self.req_blocks.get(request_id)
        keep = cdiv(num_tokens, self.block_size)
        if not blocks or len(blocks) <= keep:
            return
        tail = blocks[keep:]
        del blocks[keep:]
        self._mark_changed(request_id, keep)
        if self._num_cached.get(request_id, 0) > keep:
            self._num_cached[request_id] = keep
        self.pool.free_blocks(list(reversed(tail)))

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]


class SlidingWindowManager(GroupManager):
    """A token at position p reads positions (p - window, p]; older blocks are returned to the pool."""

    def __init__(self, group: KVCacheGroup, pool: BlockPool) -> None:
        super().__init__(group, pool)
        assert isinstance(group.spec, SlidingWindowSpec)
        self.window = group.spec.sliding_window

    def find_cache_hit(self, block_hashes: list[bytes], max_blocks: int) -> list[Block]:
        """Longest h such that the blocks covering the window before position h * block_size are cached."""
        need = cdiv(self.window - 1, self.block_size)
        run = 0
        for i in range(min(max_blocks, len(block_hashes)) - 1, -1, -1):
            if self.pool.get_cached_block(block_hashes[i]) is None:
                run = 0
                continue
            run += 1
            if run >= need or i == 0:
                hit_len = i + run
                blocks = [self.pool.null_block] * i
                blocks += [self.pool.get_cached_block(h) for h in block_hashes[i:hit_len]]
                return blocks
        return []

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        blocks = self.req_blocks.get(request_id)
        if not blocks:
            return
        # The next token to compute sits at num_computed_tokens and reads from first_needed on.
        first_needed = max(0, num_computed_tokens - self.window + 1)
        freed = []
        for i in range(min(first_needed // self.block_size, len(blocks))):
            if not blocks[i].is_null:
                if not freed:
                    self._mark_changed(request_id, i)
                freed.append(blocks[i])
                blocks[i] = self.pool.null_block
        self.pool.free_blocks(freed)


class KVCacheManager:
    def __init__(self, config: KVCacheConfig, enable_caching: bool) -> None:
        self.config = config
        self.enable_caching = enable_caching
        self.block_size = config.groups[0].spec.block_size
        self.managers: list[GroupManager] = []
        for group in config.groups:
            pool = BlockPool(config.num_blocks_of(group.group_id), enable_caching)
            cls = SlidingWindowManager if isinstance(group.spec, SlidingWindowSpec) else GroupManager
            self.managers.append(cls(group, pool))
        self.prefix_queries = 0  # in tokens, for metrics
        self.prefix_hits = 0

    @property
    def usage(self) -> float:
        return max(m.pool.usage for m in self.managers)

    def get_computed_blocks(self, request: Request) -> tuple[list[list[Block]], int]:
        """Prefix-cache hit for a request about to be scheduled: per-group blocks and the number of tokens.
        Capped so the last prompt token is always computed (its logits are needed)."""
        empty: list[list[Block]] = [[] for _ in self.managers]
        if not self.enable_caching or request.params.prompt_logprobs is not None:
            return empty, 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hit_blocks = max_blocks
        hits = empty
        # Each group may shorten the hit; iterate until every group agrees (lengths only shrink).
        while True:
            hits = [m.find_cache_hit(request.block_hashes, hit_blocks) for m in self.managers]
            shortest = min(len(h) for h in hits)
            if all(len(h) == shortest for h in hits):
                break
            hit_blocks = shortest
        self.prefix_queries += request.num_tokens
        self.prefix_hits += shortest * self.block_size
        return hits, shortest * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       hit: list[list[Block]] | None = None, num_hit_tokens: int = 0,
                       num_unready_tokens: int = 0, num_uncertain_tokens: int = 0) -> bool:
        """Make room for num_new_tokens more tokens after the computed (and hit) ones; all groups or none. The last
        num_unready_tokens of them (an asynchronous load in flight) are not offered to the prefix cache yet:
        `cache_blocks` does it once they hold their KV. The last num_uncertain_tokens computed ones are drafts whose
        verdict is in flight: the step may start that much earlier, so sliding windows keep blocks for it."""
        num_computed = request.num_computed_tokens + num_hit_tokens
        hit = hit or [[] for _ in self.managers]
        for m in self.managers:
            m.remove_skipped_blocks(request.request_id, num_computed - num_uncertain_tokens)
        total = num_computed + num_new_tokens
        for m, h in zip(self.managers, hit):
            if m.num_blocks_to_allocate(request.request_id, total, h) > m.pool.num_free_blocks:
                return False
        for m, h in zip(self.managers, hit):
            m.allocate(request.request_id, total, h)
        self.cache_blocks(request, total - num_unready_tokens)
        return True

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Offer the request's complete blocks among its first num_tokens positions to the prefix cache."""
        if not self.enable_caching:
            return
        for m in self.managers:
            if m.group.spec.prefix_cacheable:
                m.cache_blocks(request, num_tokens)

    def free(self, request: Request) -> None:
        for m in self.managers:
            m.free(request.request_id)

    def trim(self, request: Request, num_tokens: int) -> None:
        """Free every group's blocks past the first num_tokens positions (rejected draft tokens)."""
        for m in self.managers:
            m.trim(request.request_id, num_tokens)

    def take_block_changes(self, request_id: str) -> tuple[list[int], list[list[int]]]:
        """Per group: the first index of the request's block table changed since the last call, and the ids from
        there on (the step message's diff)."""
        changes = [m.take_changes(request_id) for m in self.managers]
        return [start for start, _ in changes], [ids for _, ids in changes]

    def get_block_ids(self, request_id: str, group_ids: tuple[int, ...] | None = None) -> tuple[list[int], ...]:
        ids = range(len(self.managers)) if group_ids is None else group_ids
        return tuple(self.managers[g].block_ids(request_id) for g in ids)

    def reset_prefix_cache(self) -> bool:
        return all(m.pool.reset_prefix_cache() for m in self.managers)
