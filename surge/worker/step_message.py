"""The wire form of a step, for worker processes: the driver turns a SchedulerOutput (live Request objects) into a
StepMessage that carries only what the workers have not seen; each worker keeps a cache of its requests and turns
the message back into a SchedulerOutput for its ModelRunner. Rank 0 answers with a StepResult.

A request's prompt and sampling parameters travel once, when the workers first meet it; each step then carries
the token ids they lack (one per running request in decode), the block tables, and the requests that finished.
"""
from __future__ import annotations

import msgspec
import torch

from surge.core.scheduler import ScheduledRequest, SchedulerOutput
from surge.engine.request import TokenSequence, sampling_generator
from surge.sampling_params import SamplingParams
from surge.worker.model_runner import ModelRunnerOutput


class NewRequest(msgspec.Struct, array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


class ScheduledChunk(msgspec.Struct, array_like=True):
    request_id: str
    num_computed_tokens: int
    num_new_tokens: int
    # Token ids the workers lack (the last sampled one, in decode), so they hold all the request's tokens.
    new_token_ids: list[int]
    block_ids: list[list[int]]  # per KV cache group


class StepMessage(msgspec.Struct, array_like=True, omit_defaults=True):
    scheduled: list[ScheduledChunk] = []
    new_requests: list[NewRequest] = []
    finished_ids: list[str] = []
    shutdown: bool = False


class StepResult(msgspec.Struct, array_like=True, omit_defaults=True):
    """ModelRunnerOutput on the wire (rank 0 only)."""
    sampled: dict[str, int] = {}
    logprobs: dict[str, tuple[list[int], list[float], int]] = {}
    prompt_logprobs: dict[str, tuple[int, list[list[int]], list[list[float]], list[int]]] = {}

    @staticmethod
    def from_output(out: ModelRunnerOutput) -> StepResult:
        return StepResult(out.sampled, out.logprobs, out.prompt_logprobs)

    def to_output(self) -> ModelRunnerOutput:
        return ModelRunnerOutput(self.sampled, self.logprobs, self.prompt_logprobs)


class StepEncoder:
    """Driver side: remembers how many tokens of each request the workers hold."""

    def __init__(self) -> None:
        self.known_tokens: dict[str, int] = {}
        self._encoder = msgspec.msgpack.Encoder()

    def encode(self, out: SchedulerOutput) -> bytes:
        finished = [rid for rid in out.finished_ids if self.known_tokens.pop(rid, None) is not None]
        new, chunks = [], []
        for s in out.scheduled:
            req = s.request
            rid = req.request_id
            known = self.known_tokens.get(rid)
            if known is None:
                new.append(NewRequest(rid, req.prompt_token_ids, req.params))
                known = req.num_prompt_tokens
            # All the tokens, not just up to this chunk's end: the workers' count decides who samples.
            self.known_tokens[rid] = req.num_tokens
            chunks.append(ScheduledChunk(rid, s.num_computed_tokens, s.num_new_tokens, req.token_ids[known:],
                                         list(s.block_ids)))
        return self._encoder.encode(StepMessage(chunks, new, finished))

    def encode_shutdown(self) -> bytes:
        return self._encoder.encode(StepMessage(shutdown=True))


class CachedRequest(TokenSequence):
    """A worker's view of a request: what ModelRunner reads from a Request, nothing the scheduler needs."""

    def __init__(self, new: NewRequest, device: torch.device) -> None:
        self.request_id = new.request_id
        self.prompt_token_ids = new.prompt_token_ids
        self.num_prompt_tokens = len(new.prompt_token_ids)
        self.params = new.params
        self.token_ids = list(new.prompt_token_ids)
        self.generator = sampling_generator(new.params, device)
        self.num_prompt_logprobs_done = 0


class RequestCache:
    """Worker side: applies each StepMessage to its cached requests and rebuilds the SchedulerOutput."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.requests: dict[str, CachedRequest] = {}
        self._decoder = msgspec.msgpack.Decoder(StepMessage)

    def decode(self, data: bytes) -> StepMessage:
        return self._decoder.decode(data)

    def apply(self, msg: StepMessage) -> SchedulerOutput:
        for rid in msg.finished_ids:
            self.requests.pop(rid, None)
        for new in msg.new_requests:
            self.requests[new.request_id] = CachedRequest(new, self.device)
        out = SchedulerOutput()
        for c in msg.scheduled:
            req = self.requests[c.request_id]
            req.token_ids.extend(c.new_token_ids)
            samples = c.num_computed_tokens + c.num_new_tokens == req.num_tokens  # workers step synchronously
            out.scheduled.append(ScheduledRequest(req, c.num_computed_tokens, c.num_new_tokens, tuple(c.block_ids),
                                                  samples))
        return out
