"""The encoder budget of a step: a prompt chunk that touches an image the runner's encoder cache does not hold costs
the image's encoder tokens (the whole image: the runner encodes it when a chunk first touches its span), at most
max_num_encoder_input_tokens a step, or one image larger than that alone; an image the cache holds costs nothing.

The scheduler keeps a mirror of the runner's cache (surge/worker/encoder_cache.py), fed by the same facts the step
message carries: an image is held from the step whose chunk first touches it until every request using it has
prefilled its last placeholder (released after the step) or finished; a preempted request keeps its hold.
"""
from __future__ import annotations

from surge.core.request import Request


class EncoderBudget:
    def __init__(self, max_tokens_per_step: int) -> None:
        self.max_tokens_per_step = max_tokens_per_step
        self.remaining = max_tokens_per_step
        self.users: dict[str, set[str]] = {}  # image identifier -> requests holding it in the runner's cache
        self._releases: list[tuple[str, str]] = []  # (identifier, request id) at the end of this step

    def begin_step(self) -> None:
        self.remaining = self.max_tokens_per_step

    def fit(self, req: Request, start: int, num_new: int, whole: bool = False) -> int:
        """How many of the num_new tokens from start the budget left allows: all of them, or the chunk cut before the
        first image that does not fit (0: the request waits for the next step). A step that has encoded nothing yet
        takes one image whatever its size (whole: all the chunk's images, when the chunk must not be cut), so an
        image larger than the budget runs alone in its step rather than never."""
        fresh = self.remaining == self.max_tokens_per_step
        cost = 0
        counted = set()
        for f in sorted(req.mm_features, key=lambda f: f.offset):
            if f.offset >= start + num_new:
                break
            if f.end <= start or f.identifier in self.users or f.identifier in counted:
                continue
            if cost + f.length > self.remaining and not (fresh and (cost == 0 or whole)):
                return max(0, f.offset - start)
            cost += f.length
            counted.add(f.identifier)
        return num_new

    def commit(self, req: Request, start: int, num_new: int) -> None:
        """The chunk [start, start + num_new) is scheduled: its new images spend the budget and are held."""
        end = start + num_new
        for f in req.mm_features:
            if f.offset < end and f.end > start:
                if f.identifier not in self.users:
                    self.remaining -= f.length
                self.users.setdefault(f.identifier, set()).add(req.request_id)
                if end >= max(g.end for g in req.mm_features if g.identifier == f.identifier):
                    self._releases.append((f.identifier, req.request_id))  # its last span in this prompt

    def end_step(self) -> None:
        """Images whose last placeholder a request prefilled this step: released, as the runner does after merging
        every span of the step (a prompt may hold one image twice)."""
        for identifier, request_id in self._releases:
            self.drop(identifier, request_id)
        self._releases.clear()

    def drop(self, identifier: str, request_id: str) -> None:
        users = self.users.get(identifier)
        if users is not None:
            users.discard(request_id)
            if not users:
                del self.users[identifier]

    def finish(self, req: Request) -> None:
        """A finished (or aborted) request releases every image it held."""
        for f in req.mm_features:
            self.drop(f.identifier, req.request_id)
