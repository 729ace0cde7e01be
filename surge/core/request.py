"""Request: one sequence's state as the engine core sees it (tokens, progress, status, block hashes).

`n > 1` is fanned out by the front end into independent requests before they get here.
"""
from __future__ import annotations

import enum
import time

from surge.core.kv_cache.hashing import hash_block_tokens
from surge.lora_request import LoRARequest
from surge.multimodal import MultiModalFeature, block_keys
from surge.pooling_params import PoolingParams
from surge.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"  # blocks allocated, an asynchronous KV load in flight
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)


class TokenSequence:
    """Prompt + output tokens in one list: what the model runner reads of a request, engine- or worker-side."""
    token_ids: list[int]
    num_prompt_tokens: int

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


class Request(TokenSequence):
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, block_size: int,
                 arrival_time: float | None = None, pooling_params: PoolingParams | None = None,
                 lora_request: LoRARequest | None = None, mm_features: list[MultiModalFeature] | None = None
                 ) -> None:
        """pooling_params: a pooling request (its params have max_tokens=0: the prompt only); lora_request: the
        adapter it runs with (None: the base model); mm_features: its images (placeholder spans in the prompt)."""
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.params = params
        self.pooling_params = pooling_params
        self.lora_request = lora_request
        # The adapter keys every block's hash: the same tokens under another adapter have other KV.
        self._hash_keys = () if lora_request is None else (lora_request.cache_key,)
        # Images key the blocks their placeholders touch (and, by the chain, every later one).
        self.mm_features = mm_features or []
        self.token_ids: list[int] = list(prompt_token_ids)  # prompt + output
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0  # tokens whose KV a launched step computes (advanced when it is scheduled)
        # Tokens sampled by launched steps that have not reached the host yet (async scheduling keeps one step in
        # flight; the next step reads such a token from the device).
        self.num_pending_tokens = 0
        # Draft tokens (speculative decoding) to verify in the request's next step, and how many the step in
        # flight carries.
        self.spec_token_ids: list[int] = []
        self.num_spec_in_flight = 0
        self.num_cached_tokens = -1  # prompt tokens served by the prefix cache at first scheduling
        self.num_external_cached_tokens = 0  # of those, the ones a KV connector supplied
        self.num_external_pending = 0  # tokens an asynchronous connector load is bringing in
        self.kv_transfer_params: dict | None = None  # what the connector returns to the client when it finishes
        self.skip_kv_connector = False  # a connector load for it failed: it is computed without one
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.block_size = block_size
        self.block_hashes: list[bytes] = []
        self._update_block_hashes()

    @property
    def num_tokens_with_pending(self) -> int:
        return len(self.token_ids) + self.num_pending_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self._update_block_hashes()

    def _update_block_hashes(self) -> None:
        """Hash every newly completed block; each hash chains its parent's."""
        bs = self.block_size
        for i in range(len(self.block_hashes), len(self.token_ids) // bs):
            parent = self.block_hashes[-1] if self.block_hashes else None
            keys = self._hash_keys
            if self.mm_features:
                keys += block_keys(self.mm_features, i * bs, (i + 1) * bs)
            self.block_hashes.append(hash_block_tokens(parent, self.token_ids[i * bs:(i + 1) * bs], keys))
