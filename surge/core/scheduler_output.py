"""The step message: what the scheduler hands every executor (in-process or N ranks, one shape), as diffs.

A request's prompt and sampling parameters cross once, when the runner first meets it; each step then carries, per
scheduled request, the tokens the runner lacks, the block ids that changed, and the draft tokens to verify.
"""
from __future__ import annotations

import msgspec

# gc=False: a step creates one struct per scheduled request and none can take part in a reference cycle, so the
# garbage collector need not track them (fewer collections on the hot path).

from surge.lora_request import LoRARequest
from surge.multimodal import MultiModalFeature
from surge.pooling_params import PoolingParams
from surge.sampling_params import SamplingParams


class NewRequest(msgspec.Struct, array_like=True, gc=False):
    """Sent once per request; the runner keeps it (with its sampling RNG) until the request finishes."""
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    pooling_params: PoolingParams | None = None  # a pooling request: the runner pools its prompt's hidden states
    lora_request: LoRARequest | None = None  # the adapter its tokens run with (None: the base model)
    mm_features: list[MultiModalFeature] = []  # its images: the runner encodes each before prefilling its span


class EncodeRequest(msgspec.Struct, array_like=True, gc=False):
    """An encoder-only instance's request (encoder disaggregation): the runner encodes its images and saves their
    embeddings through the EC connector; no token of it is computed."""
    request_id: str
    mm_features: list[MultiModalFeature]


class ScheduledRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    num_computed_tokens: int  # before this step
    num_new_tokens: int  # computed this step, draft tokens included
    # True when this step reaches the end of the request's tokens (the pending one included), so its last
    # position(s) yield new tokens.
    samples: bool
    # Tokens the host knows and the runner does not have yet (a token sampled by the step still in flight is not
    # among them: the runner takes it from the device).
    new_token_ids: list[int] = []
    # Per KV cache group: the runner's block ids from index block_starts[g] on are replaced by new_block_ids[g]
    # (usually an append; 0 after a preemption; shorter after a rollback freed the tail).
    block_starts: list[int] = []
    new_block_ids: list[list[int]] = []
    # Draft tokens placed after the request's last token; the runner verifies them and returns 1 + j tokens.
    spec_token_ids: list[int] = []
    # Scheduled ahead of its verdict (the step before is in flight): k drafts the runner proposed on the device
    # after that step. The row's tokens (that step's last token, then the drafts) come from the device, and it
    # starts where that verdict ended, num_computed_tokens minus the drafts it rejected (counted here as accepted).
    device_drafts: int = 0

    @property
    def num_drafts(self) -> int:
        """Drafts this step verifies for the request."""
        return len(self.spec_token_ids) + self.device_drafts


class GrammarBitmask(msgspec.Struct, array_like=True, gc=False):
    """The tokens each constrained request may sample this step (structured output): row i, num_words int32 words
    (little-endian), allows token t for request_ids[i] when bit t % 32 of word t // 32 is set; tokens past the row
    are not allowed. Requests not listed sample from unmasked logits."""
    request_ids: list[str]
    num_words: int
    bitmask: bytes


class SchedulerOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    scheduled: list[ScheduledRequest] = []
    new_requests: list[NewRequest] = []  # first scheduled this step; their entries in `scheduled` follow
    preempted_ids: list[str] = []
    # Requests finished since the last non-empty step: the runner drops their state.
    finished_ids: list[str] = []
    # LoRA adapters unloaded by the server that no request uses any more: the runners free their slots.
    removed_lora_ids: list[int] = []
    grammar_bitmask: GrammarBitmask | None = None  # structured output: applied to the logits before sampling
    encode_only: list[EncodeRequest] = []  # an encoder-only instance's requests whose images this step encodes
    kv_connector_metadata: bytes = b""  # the KV connector's instructions to its worker half (its own encoding)
    shutdown: bool = False  # executors of worker processes: the ranks stop

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled and not self.encode_only
