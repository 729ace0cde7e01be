"""Counters of speculative decoding with vLLM's meaning: drafts (request-steps that carried draft tokens), draft
tokens, accepted tokens, and accepted tokens per draft position; running totals, for metrics and benchmarks."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodingStats:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [j]: drafts whose token at position j was accepted

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One request's verdict: num_accepted of its num_draft_tokens drafts were kept (a leading run)."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_draft_tokens:
            self.accepted_per_pos.extend([0] * (num_draft_tokens - len(self.accepted_per_pos)))
        for j in range(num_accepted):
            self.accepted_per_pos[j] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verification step: 1 (the target's own) + the accepted drafts."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0
