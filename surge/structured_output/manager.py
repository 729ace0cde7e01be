"""StructuredOutputManager: the engine core's grammars, one llguidance matcher per constrained request (per sample:
n > 1 reaches the core as n requests), advanced with every token a step returns, and the step's bitmask.

Masks are filled by llguidance's thread pool, in Rust with the GIL released, straight into the buffer the runner
uploads from (pinned when it is on CUDA); the engine can do its own work meanwhile (fill_in_background). The
tokenizer bridge is built on the first constrained request, so an engine that never sees one never pays for it.
"""
from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import llguidance
import llguidance.numpy
import torch

from surge.core.scheduler_output import GrammarBitmask, SchedulerOutput
from surge.logger import init_logger
from surge.sampling_params import SamplingParams
from surge.structured_output.grammar import grammar_of
from surge.structured_output.reasoning import ReasoningMarkers
from surge.structured_output.reasoning_gate import ReasoningGate
from surge.structured_output.tokenizer import ll_tokenizer

logger = init_logger(__name__)

# Compiled grammars kept to start new requests from (a deep copy of a started matcher takes microseconds; building
# one for a large schema takes milliseconds, on the engine loop): clients tend to send the same schema again, and
# n > 1 sends it n times at once.
_GRAMMAR_CACHE_SIZE = 128


@dataclass
class RequestGrammar:
    matcher: llguidance.LLMatcher
    kind: str
    gate: ReasoningGate | None  # None: constrained from the first output token
    warned: bool = False  # a token the grammar refused was reported

    @property
    def active(self) -> bool:
        """True when this request's next token is constrained (its reasoning, if any, has ended)."""
        return self.gate is None or self.gate.open


class StructuredOutputManager:
    def __init__(self, load_tokenizer: Callable[[], object], vocab_size: int, eos_token_ids: tuple[int, ...],
                 reasoning: ReasoningMarkers | None = None, num_threads: int | None = None,
                 pin_memory: bool = False) -> None:
        """load_tokenizer: returns the HF tokenizer (called once, on the first constrained request). pin_memory: the
        masks are uploaded to a CUDA device from this process (the in-process runner)."""
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.reasoning = reasoning
        self.num_threads = num_threads
        self._hf_tokenizer = None
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._executor: llguidance.LLExecutor | None = None
        self._filler: ThreadPoolExecutor | None = None  # the thread that waits on llguidance for fill_in_background
        # With two cores llguidance's threads and the engine loop's share them, and filling behind the loop's work
        # measured slower than filling first (a loaded 2-core VM, batch 64: 0.7 ms per step filled first, 0.9 to 5 ms
        # behind 1 ms of other work).
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        self.fills_in_background = cores > 2
        self.grammars: dict[str, RequestGrammar] = {}
        self.num_words = (vocab_size + 31) // 32
        self._pin_memory = pin_memory
        self._buffers = [torch.empty((0, self.num_words), dtype=torch.int32)] * 2  # used in turn, see _next_buffer
        self._turn = 0
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()  # grammar -> its matcher at start

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            self._hf_tokenizer = self._load_tokenizer()
            self._tokenizer = ll_tokenizer(self._hf_tokenizer, self.vocab_size, self.eos_token_ids)
            self.num_words = (self._tokenizer.vocab_size + 31) // 32
            self._executor = llguidance.LLExecutor(self.num_threads)
            self._filler = ThreadPoolExecutor(1, thread_name_prefix="surge-grammar-fill")
        return self._tokenizer

    # ---- requests ----
    def compile(self, prompt_token_ids: list[int], params: SamplingParams) -> RequestGrammar | None:
        """The request's grammar, compiled and checked: ValueError (naming the field and llguidance's reason) when
        it is rejected, before anything is scheduled. None for an unconstrained request."""
        so = params.structured_outputs
        if so is None:
            return None
        grammar = grammar_of(so)
        template = self._compiled.get(grammar)
        if template is None:
            template = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
            if template.is_error():  # llguidance rejected it: its message names the place and the reason
                raise ValueError(f"structured_outputs.{so.kind} is invalid: {template.get_error().strip()}")
            self._compiled[grammar] = template
            if len(self._compiled) > _GRAMMAR_CACHE_SIZE:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(grammar)
        matcher = template.deep_copy()
        gate = None
        if self.reasoning is not None:
            gate = ReasoningGate.for_request(self.reasoning, self._hf_tokenizer, prompt_token_ids)
        return RequestGrammar(matcher, so.kind, gate)

    def add(self, request_id: str, grammar: RequestGrammar) -> None:
        self.grammars[request_id] = grammar

    def remove(self, request_ids) -> None:
        for rid in request_ids:
            self.grammars.pop(rid, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.grammars

    # ---- steps ----
    def advance(self, sampled: dict[str, list[int]]) -> None:
        """Feed each constrained request the tokens a step returned for it (1 + accepted drafts), in order."""
        if not self.grammars:
            return
        for rid, tokens in sampled.items():
            g = self.grammars.get(rid)
            if g is None or g.matcher.is_stopped():
                continue  # unconstrained, or its grammar is complete: the EOS that ends the request follows
            if g.gate is not None:
                tokens = g.gate.feed(tokens)
            if tokens and not g.matcher.consume_tokens(tokens) and not g.warned:
                # Only reachable when a token was sampled without this request's mask (never on the engine's
                # own path); the matcher stays in its error state, whose mask allows EOS alone, so the request ends.
                g.warned = True
                logger.warning("request %s: its grammar (%s) refused token(s) %s; it is ended with EOS: %s", rid,
                               g.kind, tokens, g.matcher.get_error().strip().splitlines()[0])

    def waits_for(self, in_flight: SchedulerOutput, out: SchedulerOutput) -> bool:
        """True when a constrained request samples in `out` and its previous token comes from `in_flight` (async
        scheduling): its mask depends on that token, so `out` must not launch before it is on the host."""
        if not self.grammars:
            return False
        sampling = {s.request_id for s in in_flight.scheduled if s.samples and s.request_id in self.grammars}
        return bool(sampling) and any(s.samples and s.request_id in sampling for s in out.scheduled)

    def bitmask(self, out: SchedulerOutput) -> GrammarBitmask | None:
        """The masks of the step's sampling requests whose grammar is active, filled in parallel (every token they
        returned must have been advanced first)."""
        job = self._mask_job(out)
        if job is None:
            return None
        mask, fill = job
        fill()
        return mask

    def fill_in_background(self, out: SchedulerOutput) -> Callable[[], GrammarBitmask | None]:
        """bitmask(out), filled while the caller goes on with other Python work: returns once llguidance has started
        (its Rust code runs without the GIL), and the returned function waits for the masks. Without spare cores
        (fills_in_background False) the masks are filled before it returns."""
        job = self._mask_job(out)
        if job is None:
            return lambda: None
        mask, fill = job
        if not self.fills_in_background:
            fill()
            return lambda: mask
        started = threading.Event()

        def run() -> None:
            started.set()
            fill()

        done = self._filler.submit(run)
        # A thread started while this one holds the GIL would wait for it (up to the interpreter's switch interval,
        # 5 ms) before reaching llguidance; waiting here hands the GIL over until the fill has begun.
        started.wait()

        def result() -> GrammarBitmask:
            done.result()
            return mask
        return result

    def _mask_job(self, out: SchedulerOutput) -> tuple[GrammarBitmask, Callable[[], None]] | None:
        """The step's mask (rows in the buffer to fill) and the call that fills them; None when no row is masked."""
        if not self.grammars:
            return None
        rows = [(g.matcher, s.request_id) for s in out.scheduled
                if s.samples and (g := self.grammars.get(s.request_id)) is not None and g.active]
        if not rows:
            return None
        buffer = self._next_buffer(len(rows))
        matchers = [(m, i) for i, (m, _) in enumerate(rows)]
        words = buffer.numpy()
        mask = GrammarBitmask([rid for _, rid in rows], self.num_words, memoryview(words.reshape(-1)).cast("B"))
        return mask, lambda: llguidance.numpy.fill_next_token_bitmask_par(self._executor, matchers, words)

    def _next_buffer(self, num_rows: int) -> torch.Tensor:
        """num_rows rows of one of two buffers used in turn. The runner reads a step's mask in place (its upload is
        queued with the step), and the engine has at most one step in flight and waits for it before scheduling the
        next: when the step after next asks for masks, the step that last used this buffer has completed."""
        self._turn ^= 1
        buffer = self._buffers[self._turn]
        if buffer.shape[0] < num_rows or buffer.shape[1] != self.num_words:
            buffer = torch.empty((max(num_rows, 2 * buffer.shape[0]), self.num_words), dtype=torch.int32,
                                 pin_memory=self._pin_memory)
            self._buffers[self._turn] = buffer
        return buffer[:num_rows]
