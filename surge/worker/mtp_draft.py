"""The MTP proposer (speculative_config method "deepseek_mtp"): the target checkpoint's multi-token-prediction layer
(surge/model/models/deepseek_mtp.py for V3, deepseek_v4_mtp.py for V4) as a draft model. DraftModel's machinery
runs it (its KV cache layers in the target's blocks, the verdict's start points, the decode passes, derived parallel
config), with two differences.

- Its forward over the step's tokens reads the target's final hidden states (what the target's forward hands out:
  V4's are its hyper-connection streams) and, at each position, the token after it, so it runs after sampling. A
  row's token is the step's next one; a prefill chunk's last row takes the prompt's next token; a sampling
  request's row at its last accepted position takes the token after it (the sampler's, or the verdict's bonus
  token, on the device), and that row's output gives the first draft. Rows past it (rejected
  drafts) get whatever follows: their KV is rewritten by the request's next step, which starts there.
- Its k - 1 other drafts come from decode passes that each feed the draft before with the pass before's hidden
  state (the layer's own output standing in for the target's).

It runs eagerly: its inputs (shifted tokens, hidden states) are not in the graph runners' buffers, and MLA layers
are not graph-safe yet anyway (AttentionBackend.supports_cuda_graphs_for).
"""
from __future__ import annotations

import torch
from torch import nn

from surge.model.layers.sampler import device_tensor
from surge.model.loader.base import load_from_disk
from surge.model.models.registry import get_mtp_model_class
from surge.worker.draft_model import DraftModel
from surge.worker.step_inputs import StepInputs


class MTPDraft(DraftModel):
    def __init__(self, config, device: torch.device, target: nn.Module) -> None:
        super().__init__(config, device, target)
        self.num_passes = self.k - 1  # the first draft comes from the step's own forward

    def load(self, target: nn.Module | None) -> nn.Module:
        mc = self.config.model_config
        model = load_from_disk(mc, self.device, self.config.seed, get_mtp_model_class(mc.architecture))
        model.share_target(target)
        return model

    def capture_graphs(self, step_inputs: StepInputs) -> None:
        """None: see the module's docstring."""

    def decode_pass(self, n: int, meta, hidden: torch.Tensor | None) -> torch.Tensor:
        self.counts["pass eager"] += 1
        return self.model(self.inputs.input_ids[:n], self.inputs.positions[:n], meta, hidden)

    @torch.inference_mode()
    def after_sampling(self, inputs: StepInputs, batch, hidden: torch.Tensor, last_sampled: torch.Tensor | None,
                       last_rows: dict[str, int], verified, ahead=None):
        n = batch.num_tokens
        qsl = batch.meta[0].query_start_loc
        start = self.start_points(batch, last_sampled, last_rows, verified, ahead)
        ids = torch.zeros(n, dtype=torch.int64, device=self.device)
        ids[:n - 1] = inputs.input_ids[1:n]
        chunk_rows, chunk_tokens = [], []
        for i, (s, state) in enumerate(zip(batch.scheduled, batch.states)):
            if not s.samples:  # a prefill chunk: the prompt's next token, on the host
                end = s.num_computed_tokens + s.num_new_tokens
                if end >= len(state.token_ids):
                    raise RuntimeError(f"request {s.request_id!r}: a chunk ending at {end} that samples nothing, "
                                       f"but only {len(state.token_ids)} tokens are known")
                chunk_rows.append(qsl[i + 1] - 1)
                chunk_tokens.append(state.token_ids[end])
        if chunk_rows:
            ids[device_tensor(chunk_rows, self.device, torch.long)] = device_tensor(chunk_tokens, self.device,
                                                                                    torch.long)
        if start is not None:
            rows, first, rejected, behind, positions = start
            last_row = device_tensor([qsl[i + 1] - 1 for i, s in enumerate(batch.scheduled) if s.samples],
                                     self.device, torch.long)
            accepted_row = last_row - rejected
            ids[accepted_row] = first
        self.counts["step eager"] += 1
        out = self.model(ids, inputs.positions[:n], batch.meta, hidden[:n])
        if start is None:
            return None
        self.counts["steps"] += 1
        last = out[accepted_row]
        drafts = self.greedy(last)[:, None]
        if self.num_passes:
            more = self.propose(drafts[:, 0], positions, [state.block_ids for _, state in rows],
                                behind if verified is not None else None, hidden=last)
            drafts = torch.cat((drafts, more), dim=1)
        return [s.request_id for s, _ in rows], drafts, first, rejected
