"""DeepSeek V4 against HF transformers on a tiny random checkpoint (tests/tiny_dsv4.py) with every layer type
(sliding, CSA with the indexer, HCA), both MLP types and two hyper-connection streams: logits at every step and
greedy tokens through every check of tests/hf_parity.py (prompts spanning several compression windows, chunked
prefill in 7-token chunks, prefix-cache hits, preemption, prompt logprobs); the per-layer cache specs; what is not
implemented is refused by name.

The indexer's ReLU scores are often exactly 0, so its top-k ties; Surge keeps the lower index (the documented total
order of surge/kernels/deepseek_v4_reference.indexer_topk). torch.topk, which HF calls, leaves the order of ties
unspecified, so the reference here is HF with that one choice made: its scores get -index * 1e-30, which only
separates exact ties (every other score is far larger than the nudge's ulp).
"""
from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf_v4

import hf_parity
from hf_parity import check_all, check_every_step
from surge import LLM, SamplingParams
from surge.config import ModelConfig
from surge.core.kv_cache.spec import CompressedEntrySpec, SlidingTokenRowSpec
from surge.model.loader.base import build_model
from surge.model.models.deepseek_v4 import DeepseekV4ForCausalLM
from surge.model.models.registry import MODEL_REGISTRY
from tiny_dsv4 import hf_indexer_ties_to_lower_index, make_tiny_model


@pytest.fixture(scope="module")
def ties_to_lower_index():
    with hf_indexer_ties_to_lower_index():
        yield


@pytest.fixture(scope="module", params=["deepseek-v4"])
def tiny(request, tmp_path_factory, ties_to_lower_index):
    path = make_tiny_model(request.param, tmp_path_factory.mktemp(request.param))
    return request.param, path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_deepseek_v4_matches_hf(tiny):
    check_all(*tiny)


def test_deepseek_v4_triton_path_matches_hf(tmp_path, monkeypatch, ties_to_lower_index):
    """The CUDA path on the CPU (Triton's interpreter): the batched attention (token rows written at once, windows
    pooled by the compressor kernel, the indexer's scores and top-k, the sparse attention kernel) and the mHC
    kernels, driven by device lengths only; HF's logits at every step and its greedy tokens, through a prefix-cache
    hit, prefill in 7-token chunks beside decodes, past two HCA windows. Kept small: the interpreter is slow."""
    import surge.worker.model_runner as model_runner
    from surge.attention.triton_backend import TritonAttentionBackend

    monkeypatch.setattr(model_runner, "default_backend_name", lambda device: "triton")
    launched = []
    kernels = TritonAttentionBackend.deepseek_v4_kernels
    monkeypatch.setattr(TritonAttentionBackend, "deepseek_v4_kernels",
                        lambda self, device: launched.append(device) or kernels(self, device))
    path = make_tiny_model("deepseek-v4", tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(str(path), dtype="float32", block_size=4, kv_cache_memory=1 << 22, max_num_batched_tokens=7,
              max_model_len=64)
    for cache in llm.engine.executor.runner.kv_caches:
        cache.fill_(float("nan"))  # no step may read a row no request wrote
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(3, 256, (12,), generator=g).tolist()
    greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    llm.generate([shared + [5]], greedy, use_tqdm=False)
    records = hf_parity.record_logits(llm)
    prompts = [shared + torch.randint(3, 256, (n,), generator=g).tolist() for n in (9, 3)]
    outs = llm.generate(prompts, greedy, use_tqdm=False)
    assert llm.engine.kv_cache_manager.prefix_hits > 0 and launched
    assert len(records) == 3 * len(prompts)
    runner = llm.engine.executor.runner  # the warm-up's keys (compiled on CUDA) are exactly those launched
    kernels = runner.backend.deepseek_v4_kernels(runner.device)
    for kernel, keys in runner.model.kernel_keys(kernels, 4).items():
        assert set(kernel._compiled) == set(keys), kernel.name
    hf_parity._check("deepseek-v4-triton", records, prompts, outs, hf, 256)


def test_deepseek_v4_triton_path_graph_shaped_steps_match_hf(tmp_path, monkeypatch, ties_to_lower_index):
    """What a CUDA graph replays, on the CPU: decode and small mixed steps run with the capture's metadata (no host
    lengths: seq_lens [], query_start_loc 0..n) over the padded buffers (3 decode rows in the graph of 4, in the null
    block; a mixed step's padding tokens of no request, slot -1, and empty request rows), so any host length the
    batched path read, or any padding row that leaked, would show in HF's logits."""
    import surge.worker.model_runner as model_runner
    from surge.worker.cuda_graph import CUDAGraphRunner

    class GraphShaped(CUDAGraphRunner):
        def replay(self, num_reqs, adapters=True):
            bs = self.padded_size(num_reqs)
            self.inputs.pad_decode(num_reqs, bs)
            self.replayed.append(("decode", num_reqs, bs))
            return self.model(self.inputs.input_ids[:bs], self.inputs.model_positions(bs), self._meta(bs))[:num_reqs]

        def replay_mixed(self, num_tokens, num_reqs):
            t = self.mixed_size(num_tokens, num_reqs)
            self.inputs.pad_mixed(num_tokens, num_reqs, t, self.mixed_reqs)
            self.replayed.append(("mixed", num_tokens, t))
            hidden = self.model(self.inputs.input_ids[:t], self.inputs.model_positions(t), self._mixed_meta(t))
            return hidden[:num_tokens]

    monkeypatch.setattr(model_runner, "default_backend_name", lambda device: "triton")
    path = make_tiny_model("deepseek-v4", tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(str(path), dtype="float32", block_size=4, kv_cache_memory=1 << 22, max_num_batched_tokens=20,
              max_model_len=64, max_num_seqs=4)
    runner = llm.engine.executor.runner
    assert runner.graph_safe
    graphs = runner.graph_runner = GraphShaped(runner.model, runner.inputs, runner.backend, 4, 64)
    graphs.replayed, graphs.graphs, graphs.mixed_graphs = [], dict.fromkeys(graphs.sizes), {16: None}
    for cache in runner.kv_caches:
        cache.fill_(float("nan"))
    g = torch.Generator().manual_seed(2)
    shared = torch.randint(3, 256, (12,), generator=g).tolist()
    greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    llm.generate([shared + [5]], greedy, use_tqdm=False)
    records = hf_parity.record_logits(llm)
    prompts = [shared + torch.randint(3, 256, (n,), generator=g).tolist() for n in (9, 3, 6)]
    outs = llm.generate(prompts, greedy, use_tqdm=False)
    kinds = {(kind, n < padded) for kind, n, padded in graphs.replayed}
    assert {("decode", True), ("mixed", True)} <= kinds and llm.engine.kv_cache_manager.prefix_hits > 0
    hf_parity._check("deepseek-v4-graph-shaped", records, prompts, outs, hf, 256)


def test_deepseek_v4_yarn_compress_rope_matches_hf(tmp_path, ties_to_lower_index):
    """The released configs scale the compressed layers' rope by yarn (attention factor 1.0, as HF forces it) and
    leave the sliding layers' plain."""
    path = make_tiny_model("deepseek-v4-yarn", tmp_path)
    check_every_step("deepseek-v4-yarn", path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval())


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2", "tp2-ep"])
def test_deepseek_v4_tp2_matches_one_rank(tiny, expert_parallel):
    """Two ranks (gloo): query heads, their sinks and output groups split, the shared key-value head, compressors,
    indexer and hyper-connections replicated, each rank's slice of every expert (or its whole experts) and of the
    shared one: greedy tokens identical to one rank's through every layer type and both MLP types (prompts of 5 to
    33 tokens cross several compression windows), top-2 logprobs close."""
    _, path, _ = tiny
    hf_parity.check_two_ranks_decode_as_one(str(path), expert_parallel=expert_parallel)


@pytest.mark.parametrize("field,value", [("num_attention_heads", 3), ("o_groups", 1), ("moe_intermediate_size", 33)])
def test_deepseek_v4_refuses_what_does_not_split(tmp_path, field, value):
    from surge.config import ParallelConfig

    path = make_tiny_model("deepseek-v4", tmp_path)
    config = _model_config(path, **{field: value})
    with pytest.raises(ValueError, match=rf"tensor_parallel_size=2 does not divide the model's {field}={value}"):
        DeepseekV4ForCausalLM.check_parallel(config, ParallelConfig(tensor_parallel_size=2))


def test_deepseek_v4_cache_groups(tiny):
    """Token rows in sliding groups: a sliding layer's key only (its window, 6); a compressed layer's key and
    compressor state (and the indexer's), kept over the longer of the attention's window and the compressor's (CSA
    at rate 4 reads 8 back, HCA at rate 8 reads 8). Entries in a group per rate: CSA's entry and indexer key, rate 4
    at block_size 4 one a block; HCA's, rate 8, one per two blocks (a row each). One group per distinct spec. The
    token rows' pools stop at what the running requests can hold at once (4 of them, 64 new tokens a step); the
    entries' take the rest of the budget."""
    _, path, _ = tiny
    runner = LLM(str(path), dtype="float32", block_size=4, kv_cache_memory=1 << 22, max_model_len=64, max_num_seqs=4,
                 max_num_batched_tokens=64).engine.executor.runner
    d, di, f32 = 32, 16, torch.float32
    groups = runner.kv_cache_config.groups
    assert [(g.spec, g.layer_ids) for g in groups] == [
        (SlidingTokenRowSpec(4, 1, d, f32, sliding_window=6), (0,)),
        (SlidingTokenRowSpec(4, 1, d + 4 * d + 4 * di, f32, sliding_window=8), (1, 5)),
        (CompressedEntrySpec(4, 1, d + di, f32, compress_rate=4), (2, 6)),
        (SlidingTokenRowSpec(4, 1, d + 2 * d, f32, sliding_window=8), (3,)),
        (CompressedEntrySpec(4, 1, d, f32, compress_rate=8), (4,))]
    assert all(g.spec.prefix_cacheable and g.spec.transferable for g in groups)
    kvc = runner.kv_cache_config
    n, lookback = kvc.num_blocks, 4  # lookback: 2 x (0 drafts + 2)
    rows = [4 * (-(-(w - 1 + lookback) // 4) + 2) + 64 // 4 + 1 for w in (6, 8, 8)]
    assert [kvc.num_blocks_of(g) for g in range(5)] == [rows[0], rows[1], n, rows[2], n]
    assert n > 2 * max(rows)
    pool_page_bytes = [g.spec.page_size_bytes * len(g.layer_ids) for g in groups]
    assert kvc.total_bytes == sum(b * kvc.num_blocks_of(g) for g, b in enumerate(pool_page_bytes))
    assert kvc.total_bytes <= (1 << 22) + kvc.bytes_per_block
    assert runner.kv_caches[1].shape == (1, rows[1], 4, 1, d + 4 * d + 4 * di)
    assert runner.kv_caches[2].shape == (1, n, 1, 1, d + di)
    assert groups[2].spec.page_size_bytes == (d + di) * 4
    assert CompressedEntrySpec(16, 1, d, f32, compress_rate=4).cache_shape(5) == (1, 5, 4, 1, d)
    with pytest.raises(ValueError, match="block_size=16 and compress_rate=6"):
        CompressedEntrySpec(16, 1, d, f32, compress_rate=6)


def _model_config(path, **overrides) -> ModelConfig:
    config = json.loads((path / "config.json").read_text())
    config.update(overrides)
    return ModelConfig.from_hf_config(str(path), config, {}, "float32", torch.device("cpu"),
                                      supported_architectures=tuple(MODEL_REGISTRY))


@pytest.mark.parametrize("field,value,match", [
    ("scoring_func", "softmax", r"scoring_func='softmax'"),
    ("hidden_act", "gelu", r"hidden_act='gelu'"),
    ("mlp_bias", True, r"mlp_bias=True"),
    ("quantization_config", {"quant_method": "fp8"}, r"quantization_config="),
])
def test_deepseek_v4_refuses_by_name(tmp_path, field, value, match):
    path = make_tiny_model("deepseek-v4", tmp_path)
    with pytest.raises(ValueError, match=match):
        build_model(_model_config(path, **{field: value}), torch.device("cpu"))


def test_deepseek_v4_checkpoint_names():
    """Both layouts map to the same parameters: save_pretrained's (model. prefix, head.weight) and the released
    checkpoints' (no prefix, embed.weight, attn.kv_norm, hc_head_fn); MTP tensors are skipped."""
    v4 = object.__new__(DeepseekV4ForCausalLM)  # the mapping needs no weights
    torch.nn.Module.__init__(v4)
    v4.tie_word_embeddings = False
    to = v4.checkpoint_name_to_param
    assert to("head.weight") == ("lm_head.weight", None)
    assert to("embed.weight") == ("embed_tokens.weight", None)
    assert to("model.embed_tokens.weight") == ("embed_tokens.weight", None)
    assert to("hc_head_fn") == ("hc_head.hc_fn", None)
    assert to("model.hc_head.hc_fn") == ("hc_head.hc_fn", None)
    assert to("layers.3.attn.kv_norm.weight") == to("model.layers.3.attn.norm.weight") == ("layers.3.attn.norm.weight",
                                                                                          None)
    assert to("layers.2.ffn.gate.bias") == ("layers.2.ffn.gate.e_score_correction_bias", None)
    assert to("model.layers.1.ffn.experts.5.w3.weight") == ("layers.1.ffn.experts.gate_up_proj", ("up", 5))
    assert to("layers.1.ffn.experts.5.w2.weight") == ("layers.1.ffn.experts.down_proj", ("down", 5))
    assert to("mtp.0.attn.wq_a.weight") is None


def test_deepseek_v4_flash_preset_shapes():
    """The benchmark preset (DeepSeek-V4-Flash-Base's shapes, 8 layers) builds on the meta device with as many
    parameters as HF's model of that config (the reference), and fits one H200 in bfloat16 with room for the cache.
    Its caches at block_size 16: token rows only within a window (128, or CSA's 8 / HCA's 128 state rows), and
    compressed entries of 640 values (CSA, 4 a block) or 512 (HCA, one a block: the row of every eighth block)."""
    from surge.model.presets import get_preset, preset_model_config

    mc = preset_model_config("deepseek-v4-flash-8l", "bfloat16", torch.device("cpu"), max_model_len=4096)
    with torch.device("meta"):
        model = build_model(mc, torch.device("meta"))
        hf = AutoModelForCausalLM.from_config(hf_v4.DeepseekV4Config(**get_preset("deepseek-v4-flash-8l")))
    def count(m):  # weights, whether parameters or buffers (the hash tables, HF's correction biases)
        return sum(t.numel() for name, t in m.state_dict().items() if not name.endswith(("k_scale", "v_scale", "inv_freq")))

    assert count(model) == count(hf)
    assert 100e9 < 2 * count(model) < 115e9
    specs = {attn.kv_cache_spec(16, torch.bfloat16) for attn in model.attention_layers()}
    entries = sorted((s.compress_rate, s.head_dim, s.rows_per_block) for s in specs if isinstance(s, CompressedEntrySpec))
    assert entries == [(4, 640, 4), (128, 512, 1)]
    windows = sorted(s.sliding_window for s in specs if isinstance(s, SlidingTokenRowSpec))
    assert windows == [128, 128]
