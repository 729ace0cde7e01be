"""The draft-model proposer: a smaller model sharing the tokenizer, run by the same workers beside the target, with
its own KV cache layers in the target's block tables and slot mappings (as vLLM does).

Every step the draft runs over the same tokens as the target, with the same attention metadata, so its KV follows
the target's through chunked prefill, prefix-cache hits (a cached block holds both) and preemption (both are
recomputed). After sampling, it decodes k tokens greedily from each sampling request's new last token; those KV
writes land in lookahead slots the scheduler reserved past the step's end, and the next step rewrites them.
Greedy drafting makes q a point mass on each draft, which the rejection rule takes as it takes n-gram drafts.

On the GPU every draft forward replays a CUDA graph: the step's (over the runner's buffers, the target's padding
rule) and each decode pass (over the draft's own). Where each request's proposals start depends on the verdict, so
the positions and slots are corrected on the device: the host never waits for it (a backend that reads lengths on
the host, the CPU's, reads the correction), and under async scheduling the next step verifies the drafts before
the host has seen them. `counts` says how each forward ran and how often the host waited (bench latency prints
them per step).

A DeepSeek-V3 checkpoint's MTP layer is a draft of this kind too (MTPDraft, mtp_draft.py): it overrides how the
step's forward and the decode passes read their inputs (after_sampling, decode_pass), the rest is shared.
"""
from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np
import torch
from torch import nn

from surge.attention.backend import AttentionBackend
from surge.config import EngineConfig
from surge.core.kv_cache.spec import KVCacheConfig, build_kv_cache_groups
from surge.distributed.parallel_state import get_tp_group
from surge.logger import init_logger
from surge.model.layers.sampler import device_tensor
from surge.model.loader.base import load_model
from surge.worker.cuda_graph import CUDAGraphRunner, capture_sizes
from surge.worker.step_inputs import StepInputs

logger = init_logger(__name__)


class DraftModel:
    def __init__(self, config: EngineConfig, device: torch.device, target: nn.Module | None = None) -> None:
        """target: the target model, for a draft that shares its modules (MTPDraft)."""
        sc = config.speculative_config
        assert sc is not None and sc.uses_draft_model and sc.draft is not None
        parallel = sc.draft_parallel_config(config.parallel_config)
        if parallel.tensor_parallel_size != config.parallel_config.tensor_parallel_size:
            raise ValueError(f"speculative_config.draft_tensor_parallel_size={parallel.tensor_parallel_size}: a "
                             "draft on fewer ranks than the target is not supported yet; leave it unset (the "
                             f"target's {config.parallel_config.tensor_parallel_size})")
        self.config = dataclasses.replace(config, model_config=sc.draft, parallel_config=parallel)
        # Expert parallelism reaches the draft through the process's groups, which the target's config made: the
        # draft's (derived by DRAFT_PARALLEL_POLICY) must say the same.
        assert parallel.enable_expert_parallel == config.parallel_config.enable_expert_parallel
        self.k = sc.num_speculative_tokens
        self.num_passes = self.k  # decode passes per proposal
        self.device = device
        self.tp = get_tp_group()
        self.model = self.load(target)
        logger.info("loaded the draft %s (%s, %d layers) for k=%d", type(self.model).__name__, sc.draft.dtype,
                    len(self.model.attention_layers()), self.k)
        self.kv_caches: list[torch.Tensor] = []
        self.inputs: StepInputs | None = None
        self.graph_runner: CUDAGraphRunner | None = None  # decode passes, over self.inputs
        self.step_graphs: CUDAGraphRunner | None = None  # each step's forward, over the runner's StepInputs
        self.backend: AttentionBackend | None = None
        self.graph_safe = False  # whether the backend may replay the draft's layers in graphs (bind_kv_cache)
        # "steps"; "step graph" / "step eager", "pass graph" / "pass eager": draft forwards by how they ran;
        # "host waits": device values the host read (each makes the host wait for the device's queue)
        self.counts: Counter[str] = Counter()

    def load(self, target: nn.Module | None) -> nn.Module:
        return load_model(self.config, self.device)

    def bytes_per_block(self, block_size: int) -> int:
        """What one block id costs in the draft's layers (added to the target's when the cache is sized)."""
        return KVCacheConfig(self._groups(block_size), num_blocks=2).bytes_per_block

    def _groups(self, block_size: int):
        dtype = self.config.cache_config.cache_dtype(self.config.model_config.dtype)
        return build_kv_cache_groups([attn.kv_cache_spec(block_size, dtype) for attn in self.model.attention_layers()])

    def bind_kv_cache(self, target: KVCacheConfig, backend: AttentionBackend) -> None:
        """One cache tensor per draft layer, addressed through the target group of the same attention kind."""
        mc, cc, sc = self.config.model_config, self.config.cache_config, self.config.scheduler_config
        self.backend = backend
        self.graph_safe = backend.supports_cuda_graphs_for(
            tuple(dict.fromkeys(attn.params for attn in self.model.attention_layers())))
        windows = {getattr(g.spec, "sliding_window", None): g.group_id for g in target.groups}
        specs = {g.spec: g.group_id for g in target.groups}
        dtype = cc.cache_dtype(mc.dtype)
        for layer_id, attn in enumerate(self.model.attention_layers()):
            # A layer of the target's own kind (an MTP layer: DeepSeek V4's token rows and compressed entries,
            # whose groups differ by more than a window) goes to the group of its very spec; another draft's, to
            # the group keeping what its window reads.
            group_id = specs.get(attn.kv_cache_spec(cc.block_size, dtype))
            window = attn.sliding_window
            if group_id is None and window not in windows:
                kind = "full attention" if window is None else f"a sliding window of {window}"
                raise ValueError(f"speculative_config.model={self.config.model_config.model!r}: its layer {layer_id} "
                                 f"has {kind}, which no KV cache group of the target has (the draft shares the "
                                 "target's block tables)")
            group = target.groups[windows[window] if group_id is None else group_id]
            shape = backend.kv_cache_shape(target.num_blocks_of(group.group_id),
                                           attn.kv_cache_spec(group.spec.block_size, dtype))
            cache = torch.zeros(shape, dtype=dtype, device=self.device)
            attn.kv_cache, attn.group_id, attn.backend = cache, group.group_id, backend
            self.kv_caches.append(cache)
        self.inputs = StepInputs(sc.max_num_seqs, sc.max_num_seqs, -(-mc.max_model_len // cc.block_size),
                                 len(target.groups), cc.block_size, self.device)
        self._warm_up(backend)

    def capture_graphs(self, step_inputs: StepInputs) -> None:
        """CUDA graphs of the draft, after the runner made its StepInputs: one set over the draft's own buffers for
        the decode passes, one over the runner's for each step's forward (mixed steps included: eager, the step's
        forward was ~10 launches per layer from the host every step, a verification's k + 1 tokens among them)."""
        mc, sc = self.config.model_config, self.config.scheduler_config
        if self.config.enforce_eager or self.backend is None or not self.graph_safe:
            return
        self.graph_runner = CUDAGraphRunner(self.model, self.inputs, self.backend, sc.max_num_seqs,
                                            mc.max_model_len)
        self.graph_runner.capture()
        self.step_graphs = CUDAGraphRunner(self.model, step_inputs, self.backend, sc.max_num_seqs, mc.max_model_len)
        self.step_graphs.capture()

    def _warm_up(self, backend: AttentionBackend) -> None:
        mc, cc, sc = self.config.model_config, self.config.cache_config, self.config.scheduler_config
        params = tuple(dict.fromkeys(attn.params for attn in self.model.attention_layers()))
        sizes = capture_sizes(sc.max_num_seqs) if not self.config.enforce_eager else []
        backend.warm_up(self.device, params, cc.block_size, mc.dtype, sizes, sc.max_num_seqs,
                        self.config.warmup_workers, cc.cache_dtype(mc.dtype))

    def after_sampling(self, inputs: StepInputs, batch, hidden: torch.Tensor, last_sampled: torch.Tensor | None,
                       last_rows: dict[str, int], verified, ahead=None):
        """The draft's work once the step sampled: its KV for the step's tokens, then propose_after's proposals.
        hidden: the target's final hidden states of the step's tokens (unused here: MTPDraft reads them)."""
        self.forward_step(inputs, batch.num_tokens, batch.meta)
        return self.propose_after(batch, last_sampled, last_rows, verified, ahead)

    def forward_step(self, inputs: StepInputs, num_tokens: int, meta) -> None:
        """The step's tokens through the draft, with the target's inputs and metadata: its KV for them. A graph
        where the target's rule gives one (a decode batch, or a mixed step small enough), else eager."""
        graphs, num_reqs = self.step_graphs, meta[0].num_reqs
        if graphs is not None:
            if meta[0].decode_only and graphs.padded_size(num_reqs):
                self.counts["step graph"] += 1
                graphs.replay(num_reqs)
                return
            if not meta[0].decode_only and graphs.mixed_size(num_tokens, num_reqs):
                self.counts["step graph"] += 1
                graphs.replay_mixed(num_tokens, num_reqs)
                return
        self.counts["step eager"] += 1
        self.model(inputs.input_ids[:num_tokens], inputs.positions[:num_tokens], meta)

    @torch.inference_mode()
    def propose(self, first_tokens: torch.Tensor, positions: list[int], block_ids: list[list[list[int]]],
                behind: torch.Tensor | None = None, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """num_passes greedy tokens [n, num_passes] per request from its new last token (first_tokens [n], on every
        rank) at positions[i] - behind[i] (behind: on the device, None: 0), its block table per group
        block_ids[i]; hidden: what the first pass reads beside it (an MTP layer's). A position past the request's
        blocks (the end of max_model_len) writes to the null block; its drafts are cut off by the engine anyway."""
        inp, bs = self.inputs, self.config.cache_config.block_size
        n, k = len(positions), self.num_passes
        pos = np.asarray(positions, dtype=np.int64)[None, :] + np.arange(k, dtype=np.int64)[:, None]  # [k, n]
        parts, widths = [pos.reshape(-1)], []
        for g in range(len(inp.block_tables)):
            rows = [b[g] for b in block_ids]
            width = max(1, max(len(r) for r in rows))
            table = np.zeros((n, width), dtype=np.int64)
            for i, r in enumerate(rows):
                table[i, :len(r)] = r
            parts += [table.reshape(-1), np.asarray([len(r) for r in rows], dtype=np.int64)]
            widths.append(width)
        dev = device_tensor(np.concatenate(parts), self.device)  # one copy, queued: the host does not wait for it
        pos_dev, o = dev[:k * n].view(k, n), k * n
        if behind is not None:
            pos_dev = pos_dev - behind[None, :]
            if not self.graph_safe:  # it reads the lengths on the host: the exact ones
                self.counts["host waits"] += 1
                pos = pos - np.asarray(behind.tolist(), dtype=np.int64)[None, :]
        slot_dev, col = [], pos_dev // bs
        for g, width in enumerate(widths):
            table, o = dev[o:o + n * width].view(n, width), o + n * width
            lengths, o = dev[o:o + n], o + n
            block = table[torch.arange(n, device=self.device)[None, :], col.clamp_max(width - 1)]
            slot_dev.append(torch.where(col < lengths[None, :], block, 0) * bs + pos_dev % bs)  # [k, n]
            inp.block_tables[g][:n].zero_()
            inp.block_tables[g][:n, :width].copy_(table)
        inp.query_start_loc[:n + 1].copy_(torch.arange(n + 1, device=self.device))
        inp.input_ids[:n].copy_(first_tokens)
        drafts = torch.empty(n, k, dtype=torch.int64, device=self.device)
        for j in range(k):
            inp.positions[:n].copy_(pos_dev[j])
            inp.seq_lens[:n].copy_(pos_dev[j] + 1)
            for g, slots in enumerate(slot_dev):
                inp.slot_mapping[g][:n].copy_(slots[j])
            seq_lens = (pos[j] + 1).tolist()  # exact, or upper bounds (the kernels read the device's)
            meta = inp.metadata(self.backend, n, n, list(range(n + 1)), seq_lens, 1, max(seq_lens))
            hidden = self.decode_pass(n, meta, hidden)
            nxt = self.greedy(hidden)
            drafts[:, j] = nxt
            inp.input_ids[:n].copy_(nxt)
        return drafts

    def decode_pass(self, n: int, meta, hidden: torch.Tensor | None) -> torch.Tensor:
        """One token per request through the draft, its inputs in self.inputs; returns its hidden states [n, H]."""
        graphs = self.graph_runner
        if graphs is not None and graphs.padded_size(n):
            self.counts["pass graph"] += 1
            return graphs.replay(n)
        self.counts["pass eager"] += 1
        return self.model(self.inputs.input_ids[:n], self.inputs.positions[:n], meta)

    def greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        """The draft's argmax token of each row [n], on every rank (rank 0 computes the logits)."""
        logits = self.model.compute_logits(hidden)  # rank 0 only
        nxt = logits.argmax(dim=-1) if logits is not None else torch.empty(hidden.shape[0], dtype=torch.int64,
                                                                            device=self.device)
        return self.tp.broadcast(nxt)

    def propose_after(self, batch, last_sampled: torch.Tensor | None, last_rows: dict[str, int],
                      verified, ahead=None):
        """Proposals for every request that sampled this step, from its new last token: the sampler's, or for a
        request with drafts the token after its accepted ones (rank 0 decided; the others learn it, and how many
        were accepted, by one broadcast). Returns None, or (request ids, drafts [n, k], the new last tokens [n],
        the drafts each rejected [n]), the last three on the device: what a step scheduled ahead of this one's
        verdict starts from (StepInputs.DeviceDrafts; ahead: the one this step started from)."""
        start = self.start_points(batch, last_sampled, last_rows, verified, ahead)
        if start is None:
            return None
        rows, first_t, rejected, behind, positions = start
        self.counts["steps"] += 1
        drafts = self.propose(first_t, positions, [state.block_ids for _, state in rows],
                              behind if verified is not None else None)
        return [s.request_id for s, _ in rows], drafts, first_t, rejected

    def start_points(self, batch, last_sampled: torch.Tensor | None, last_rows: dict[str, int], verified,
                     ahead=None):
        """Where each sampling request's proposals start: None when no request sampled, else (its rows (scheduled,
        state), its new last token [n] and the drafts this step rejected [n], on the device, how far before the
        host's count it starts [n] (those and, for a row scheduled ahead, the verdict before's), and the host's
        count: the step's end)."""
        rows = [(s, state) for s, state in zip(batch.scheduled, batch.states) if s.samples]
        if not rows:
            return None
        n = len(rows)
        rejected = torch.zeros(n, dtype=torch.int64, device=self.device)
        first = [None] * n
        if verified is not None:
            ids, num_drafts, out = verified
            buf = torch.zeros(2, len(ids), dtype=torch.int64, device=self.device)
            if out is not None:
                starts = np.cumsum([0] + [k + 1 for k in num_drafts[:-1]], dtype=np.int64)  # each request's rows
                buf[0] = out.token_ids[device_tensor(starts, self.device) + out.num_accepted]
                buf[1] = out.num_accepted
            buf = self.tp.broadcast(buf)
            at = {s.request_id: i for i, (s, _) in enumerate(rows)}
            where = [at[rid] for rid in ids]
            rejected.index_copy_(0, device_tensor(where, self.device, torch.long),
                                 device_tensor(np.asarray(num_drafts, dtype=np.int64), self.device) - buf[1])
            for j, i in enumerate(where):
                first[i] = buf[0, j]
        # Where each proposal starts: the step's end as the host counted it (the sampled token's position for a
        # plain row), less the drafts the verdict rejected, and less those the verdict before rejected for a row
        # scheduled ahead of it (it started that much earlier).
        behind = rejected
        prev = [(i, ahead.rows[s.request_id]) for i, (s, _) in enumerate(rows) if s.device_drafts]
        if prev:
            i_t, j_t = (device_tensor([p[c] for p in prev], self.device, torch.long) for c in (0, 1))
            behind = rejected.index_add(0, i_t, ahead.rejected.index_select(0, j_t))
        positions = []
        for i, (s, _) in enumerate(rows):
            positions.append(s.num_computed_tokens + s.num_new_tokens)
            if first[i] is None:
                first[i] = last_sampled[last_rows[s.request_id]]
        return rows, torch.stack(first), rejected, behind, positions
