"""The instances behind the proxy: least outstanding requests first, and one that just failed is tried last (and
again, once its pause is over or nothing else is left), so an instance that comes back serves again by itself."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

FAILURE_PAUSE_S = 2.0  # after a failed connection, an instance goes to the back of the line for this long


@dataclass
class Instance:
    url: str  # http://host:port, no trailing slash
    role: str  # "encode" | "prefill" | "decode"
    outstanding: int = 0
    failed_at: float = field(default=-1e9)
    num_requests: int = 0
    num_failures: int = 0

    @property
    def paused(self) -> bool:
        return time.monotonic() - self.failed_at < FAILURE_PAUSE_S


def parse_url(url: str, flag: str) -> str:
    parts = urlsplit(url if "://" in url else f"http://{url}")
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.port is None:
        raise ValueError(f"{flag} {url!r} must be an instance's base URL with a port, e.g. http://127.0.0.1:8100")
    return f"{parts.scheme}://{parts.netloc}"


class Pool:
    def __init__(self, role: str, urls: list[str]) -> None:
        if not urls:
            raise ValueError(f"--{role}: give at least one {role} instance URL")
        self.role = role
        self.instances = [Instance(parse_url(u, f"--{role}"), role) for u in urls]
        self._next = 0  # ties go round-robin

    def order(self, exclude: Instance | None = None) -> list[Instance]:
        """Candidates, best first: not paused, then fewest outstanding requests, ties rotating."""
        n = len(self.instances)
        self._next = (self._next + 1) % n
        rotated = self.instances[self._next:] + self.instances[:self._next]
        ranked = sorted(rotated, key=lambda i: (i.paused, i.outstanding))
        return [i for i in ranked if i is not exclude] or ranked
