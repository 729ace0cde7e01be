"""Incremental detokenization: turns a request's newly generated token ids into text, one engine step at a time.

Also finds stop strings in that text (even when split across tokens) and holds back text that may begin one.
"""
from __future__ import annotations

import functools

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from surge.sampling_params import SamplingParams

# Prompt tokens decoded as context before the output. SentencePiece-style decoders drop the leading space of the
# first token they see, so the output needs at least one token before it; a few more cover skipped special tokens.
_CONTEXT_TOKENS = 8
# What a decode shows for a character whose bytes have not all arrived yet.
_INCOMPLETE = "\ufffd"


def _backend(tokenizer) -> Tokenizer:
    """The `tokenizers.Tokenizer` behind a transformers fast tokenizer (or the tokenizer itself)."""
    return getattr(tokenizer, "backend_tokenizer", tokenizer)


@functools.lru_cache(maxsize=16)
def _byte_run_ids(tokenizer: Tokenizer, skip_special_tokens: bool) -> frozenset[int]:
    """For a byte-fallback vocabulary (Llama-2 style), ids that may leave a run of <0xNN> tokens unfinished: those
    tokens, and special tokens when the decode skips them. Empty for other tokenizers."""
    ids = {tokenizer.token_to_id(f"<0x{byte:02X}>") for byte in range(256)} - {None}
    if ids and skip_special_tokens:
        ids |= {i for i, token in tokenizer.get_added_tokens_decoder().items() if token.special}
    return frozenset(ids)


@functools.lru_cache(maxsize=16)
def _special_ids(tokenizer: Tokenizer) -> frozenset[int]:
    return frozenset(i for i, token in tokenizer.get_added_tokens_decoder().items() if token.special)


def special_token_ids(tokenizer) -> frozenset[int]:
    """Ids a decode with skip_special_tokens=True leaves out."""
    return _special_ids(_backend(tokenizer))


@functools.lru_cache(maxsize=1 << 18)
def decode_token(tokenizer, token_id: int) -> str:
    """One token's text on its own, as logprob entries show it; cached since top-N logprobs repeat tokens."""
    return _backend(tokenizer).decode([token_id], skip_special_tokens=False)


class IncrementalDetokenizer:
    """Text of one request's output so far, with stop-string truncation and a delta stream for streaming.

    The text equals a full decode of prompt + output minus the prompt's text: for byte-level tokenizers that is
    `tokenizer.decode(output_ids)`, for SentencePiece ones it keeps the first token's leading space.
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._tokenizer = _backend(tokenizer)
        self._skip_special_tokens = params.skip_special_tokens
        self._stop: list[str] = list(params.stop or [])
        self._include_stop = params.include_stop_str_in_output
        self._max_stop_len = max(map(len, self._stop), default=0)
        # Like EOS and stop token ids, stop strings cannot end the output before min_tokens tokens (as in vLLM).
        self._min_tokens = params.min_tokens
        # Text that may still turn out to start a stop string; none when a matched stop string stays in the output.
        self._holdback = 0 if self._include_stop else max(self._max_stop_len - 1, 0)

        context = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        if self._decode(context).endswith(_INCOMPLETE):
            context = []  # the prompt ends mid-character: its text is no prefix of the prompt + output text
        # ByteFallback renders a whole run of <0xNN> tokens at once, as U+FFFD per byte if any is invalid, so text
        # already released can change; DecodeStream cannot take that back, so such models wait for a run's end.
        self._byte_run_ids = _byte_run_ids(self._tokenizer, self._skip_special_tokens)
        self._stream: DecodeStream | None = None
        if not self._byte_run_ids:
            self._stream = DecodeStream(ids=context, skip_special_tokens=self._skip_special_tokens)
        self._ids = context  # the context, then every generated token
        self._num_context = len(context)
        self._prefix_offset = 0  # vLLM's offsets: ids[prefix_offset:num_read] decode to text already released,
        self._num_read = len(context)  # and ids from num_read on are held back (mid-character)
        self._text = ""  # released text: final, it only grows
        self._held_text: str | None = ""  # text of the held-back ids; None: not decoded yet
        self._final_text: str | None = None  # set once a stop string matched
        self._num_emitted = 0  # characters returned by get_next_delta

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _step(self, token_id: int) -> str | None:
        """New text once ids up to `token_id` decode to whole characters, else None."""
        if self._stream is not None:
            try:
                return self._stream.step(self._tokenizer, token_id)
            except Exception as e:  # a decoder whose text for earlier tokens changed: go on without the stream
                if "Invalid prefix" not in str(e):
                    raise
                self._stream = None
        if token_id in self._byte_run_ids:
            return None
        released = self._decode(self._ids[self._prefix_offset:self._num_read])
        text = self._decode(self._ids[self._prefix_offset:])
        if len(text) <= len(released) or text.endswith(_INCOMPLETE):
            return None
        return text[len(released):]

    def update(self, new_token_ids: list[int]) -> str | None:
        """Append generated tokens; return the stop string that matched (the text then ends before it, or
        includes it when params.include_stop_str_in_output), else None. Only a match that a token after the first
        min_tokens completes counts. After a match, callers stop the request and any further tokens are ignored."""
        if self._final_text is not None:
            return None
        num_released = len(self._text)
        for token_id in new_token_ids:
            self._ids.append(token_id)
            chunk = self._step(token_id)  # one token at a time: a stream holds back a whole step mid-character
            if chunk is not None:
                self._text += chunk
                self._prefix_offset, self._num_read = self._num_read, len(self._ids)
        self._held_text = "" if self._num_read == len(self._ids) else None
        num_generated = len(self._ids) - self._num_context
        if not self._stop or len(self._text) == num_released or num_generated <= self._min_tokens:
            return None
        # Stop strings are searched in released text only, whose characters are final. Earlier text held none
        # (else the request would have stopped), so a new match ends past it.
        return self._find_stop(max(0, num_released - self._max_stop_len + 1))

    def _find_stop(self, start: int) -> str | None:
        # "Earliest" is the match that completes first, as a character-by-character scan would see it, so the result
        # does not depend on how tokens were grouped into steps; between equal ends the longer stop string wins.
        best: tuple[int, int, str] | None = None  # (end, start, stop string)
        for stop in self._stop:
            begin = self._text.find(stop, start)
            if begin >= 0 and (best is None or (begin + len(stop), begin) < best[:2]):
                best = (begin + len(stop), begin, stop)
        if best is None:
            return None
        end, begin, stop = best
        self._final_text = self._text[:end] if self._include_stop else self._text[:begin]
        return stop

    @property
    def output_text(self) -> str:
        """Full text generated so far (stop string handled as update() says). Held-back ids (an unfinished
        character) show as a full decode shows them, with U+FFFD."""
        if self._final_text is not None:
            return self._final_text
        if self._held_text is None:
            released = self._decode(self._ids[self._prefix_offset:self._num_read])
            self._held_text = self._decode(self._ids[self._prefix_offset:])[len(released):]
        return self._text + self._held_text

    def get_next_delta(self, finished: bool) -> str:
        """Text not yet returned by earlier calls. While not finished it holds back the last
        (max stop-string length - 1) characters, since they may turn out to start a stop string, and any
        unfinished character; finished=True flushes."""
        if finished or self._final_text is not None:
            text = self.output_text
            end = len(text)
        else:
            text = self._text
            end = len(text) - self._holdback
        if end <= self._num_emitted:
            return ""
        delta = text[self._num_emitted:end]
        self._num_emitted = end
        return delta
