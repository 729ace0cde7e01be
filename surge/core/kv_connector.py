"""What the scheduler and the step result know of a KV connector (surge/kv_transfer): the scheduler-side calls it
makes, and the worker side's report of finished loads and saves. Interfaces only; connectors live above.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import msgspec

if TYPE_CHECKING:
    from surge.core.request import Request
    from surge.core.scheduler_output import SchedulerOutput


class KVConnectorOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The worker side's report after a step (agreed by every rank)."""
    finished_sending: list[str] = []  # saves done: the blocks a finished request held may be freed
    finished_recving: list[str] = []  # asynchronous loads done: the request may run
    failed_recving: list[str] = []  # asynchronous loads that failed or came back partial: recompute
    loaded_bytes: int = 0
    saved_bytes: int = 0
    load_seconds: float = 0.0
    save_seconds: float = 0.0
    failed_sending: list[str] = []  # of finished_sending, the saves that failed (blocks freed all the same)


class SchedulerConnector(Protocol):
    """The scheduler half of a KV connector."""

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens beyond the first num_computed_tokens (the local prefix hit, block-aligned) that the connector can
        supply, and whether it loads them asynchronously. At most num_tokens - 1 - num_computed_tokens."""

    def update_state_after_alloc(self, request: Request, block_ids: tuple[list[int], ...],
                                 num_external_tokens: int) -> None:
        """Blocks are allocated for the request (block_ids: every group's); load num_external_tokens into them."""

    def build_connector_meta(self, out: SchedulerOutput) -> bytes:
        """The worker half's instructions for this step (loads, saves), encoded; b"" for none."""

    def request_finished(self, request: Request, block_ids: tuple[list[int], ...]) -> tuple[bool, dict | None]:
        """The request finished: (hold its blocks until the worker reports the save done, kv_transfer_params)."""

    def has_pending_work(self) -> bool:
        """True while the worker half has something to do or report even with no request scheduled."""

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """Bookkeeping after a step: stats, failures."""
