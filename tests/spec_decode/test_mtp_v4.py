"""DeepSeek V4's MTP layer as the draft (speculative_config method "deepseek_mtp") on tiny V4 checkpoints that ship
one as DeepSeek's do (`mtp.0.*`; tests/tiny_dsv4.py): every draft of a random CSA layer over a target of every layer
type equals a plain reference built from HF's own V4 block and the target's streams as HF computes them (k = 1,
and k = 2 recurrent through chunked prefill and preemption); greedy output is identical to decoding without
speculation; a copy of the target's layer is accepted; tensor and expert parallelism reach it."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from mtp_checks import (assert_drafts_equal_the_reference, draft_as_rank_1_of_2, mtp_spec, one_rank_and_two,
                        speculate_as_without)
from safetensors.torch import load_file, save_file
from tiny_dsv4 import hf_indexer_ties_to_lower_index, make_tiny_v4_mtp_model, mtp_block_checkpoint
from transformers import AutoModelForCausalLM

from surge import LLM, SamplingParams
from surge.model.models.deepseek_v4_mtp import DeepseekV4MTP, mtp_layer_type

BASE = {"block_size": 4, "device": "cpu"}
ENGINES = {"plain": {"kv_cache_memory": 1 << 22, "max_model_len": 128},
           "preempted-chunked": {"num_gpu_blocks_override": 24, "max_num_batched_tokens": 16, "max_model_len": 64}}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {"copy": make_tiny_v4_mtp_model(tmp_path_factory.mktemp("copy") / "m", "copy"),
            "random": make_tiny_v4_mtp_model(tmp_path_factory.mktemp("random") / "m", "random", copies=True)}


class Reference:
    """The MTP draft computed plainly, as DeepSeek's reference writes the layer: the target's last-layer streams S
    (HF's, the input of its hc_head), e_proj(enorm(embed(next token))) added to h_proj(hnorm(S)) on every stream,
    HF's DeepseekV4DecoderLayer holding the MTP block (a one-layer HF model's, its input streams replaced), the
    layer's own hc_head collapse and norm, the target's LM head; pass j > 1 feeds draft j - 1 and the pass
    before's output streams."""

    def __init__(self, path) -> None:
        self.hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.block = AutoModelForCausalLM.from_pretrained(mtp_block_checkpoint(path), dtype=torch.float32).eval()
        self.w = {n.removeprefix("mtp.0."): t for n, t in load_file(str(path / "model-mtp.safetensors")).items()}
        config = self.hf.config
        self.eps, self.hc_eps, self.hc = config.rms_norm_eps, config.hc_eps, config.hc_mult

    def _norm(self, x: torch.Tensor, name: str | None) -> torch.Tensor:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x if name is None else x * self.w[f"{name}.weight"]

    def _streams_in(self, embeds: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
        e = self._norm(embeds, "enorm") @ self.w["e_proj.weight"].T
        return (self._norm(streams, "hnorm") @ self.w["h_proj.weight"].T) + e.unsqueeze(-2)

    def _hc_head(self, streams: torch.Tensor) -> torch.Tensor:
        mix = F.linear(self._norm(streams.flatten(-2), None), self.w["hc_head_fn"])
        pre = torch.sigmoid(mix * self.w["hc_head_scale"] + self.w["hc_head_base"]) + self.hc_eps
        return (pre.unsqueeze(-1) * streams).sum(-2)

    def _run(self, model, inputs: dict, layer: torch.nn.Module, replace: torch.Tensor | None = None) -> torch.Tensor:
        """model's forward, the streams entering `layer` replaced (if given); returns the streams leaving it."""
        seen = []
        hooks = [layer.register_forward_hook(lambda m, a, out: seen.append(out))]
        if replace is not None:
            hooks.append(layer.register_forward_pre_hook(lambda m, a: (replace[None], *a[1:])))
        try:
            model(**inputs)
        finally:
            for h in hooks:
                h.remove()
        return seen[0][0]

    @torch.no_grad()
    def drafts(self, tokens: list[int], k: int) -> tuple[list[int], list[float]]:
        """The k drafts after tokens (its newest not yet through the target), and each one's top-2 logit margin."""
        m = len(tokens) - 1
        target = self.hf.model
        streams = self._run(target, {"input_ids": torch.tensor([tokens[:m]])}, target.layers[-1])  # [m, hc, D]
        xs = [self._streams_in(target.embed_tokens(torch.tensor(tokens[1:])), streams)]
        drafts, margins = [], []
        for _ in range(k):
            x = torch.cat(xs)
            out = self._run(self.block.model, {"inputs_embeds": torch.zeros(1, x.shape[0], x.shape[-1])},
                            self.block.model.layers[0], replace=x)[-1]
            logits = self.hf.lm_head(self._norm(self._hc_head(out), "norm"))
            top = logits.topk(2)
            drafts.append(int(top.indices[0]))
            margins.append(float(top.values[0] - top.values[1]))
            xs.append(self._streams_in(target.embed_tokens(torch.tensor([drafts[-1]])), out[None]))
        return drafts, margins


@pytest.mark.parametrize(("k", "engine"), [(1, "plain"), (2, "preempted-chunked")])
def test_drafts_equal_the_reference(checkpoints, k, engine):
    """The random layer's drafts are mostly rejected, so the step forward's rows past the accepted position are
    junk (rewritten by the next step, compressed entries included) and every proposal must still equal the
    reference's from the whole sequence. The checkpoint ships mtp.0.embed and mtp.0.head, equal to the target's."""
    path = checkpoints["random"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    run = speculate_as_without(path, k, params, {**BASE, **ENGINES[engine]})
    if engine == "preempted-chunked":
        assert run.llm.engine.scheduler.num_preemptions > 0
    assert len(run.proposals) > 20
    with hf_indexer_ties_to_lower_index():
        assert_drafts_equal_the_reference(run.proposals, Reference(path))


@pytest.mark.parametrize("k", [1, 2])
def test_greedy_identical_and_a_copy_of_the_target_layer_accepted(checkpoints, k):
    path = checkpoints["copy"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    run = speculate_as_without(path, k, params, {**BASE, **ENGINES["plain"]})
    proposed, accepted = run.proposed, run.accepted
    print(f"deepseek_mtp v4 k={k}: {accepted}/{proposed} drafts accepted ({accepted / proposed:.0%})")
    assert proposed > 0 and accepted > proposed // 2
    assert run.llm.engine.kv_cache_manager.usage == 0.0


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2", "tp2-ep"])
def test_two_ranks_propose_as_one(checkpoints, expert_parallel):
    """TP=2 (gloo), the MTP block's heads, output groups and (with expert parallelism) experts split like the
    target's: the same output and the same drafts accepted as on one rank."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    (one, counts_one), (two, counts_two) = one_rank_and_two(checkpoints["copy"], 2, params, expert_parallel,
                                                            {**BASE, **ENGINES["plain"]})
    assert [o.outputs[0].token_ids for o in two] == [o.outputs[0].token_ids for o in one]
    assert counts_two == counts_one and counts_one[1] > 0


def test_the_draft_splits_as_the_target(checkpoints):
    """Built as rank 1 of two under the draft's ParallelConfig (derived by DRAFT_PARALLEL_POLICY, which inherits
    expert parallelism): with it the MTP block holds experts 2..3 of 4, whole; without, half of each of the 4; its
    heads and output groups halved either way, its e_proj and hc_head whole."""
    for ep, layout in ((True, (2, 2, 32)), (False, (4, 0, 16))):
        model = draft_as_rank_1_of_2(checkpoints["random"], ep, DeepseekV4MTP)
        layer = model.layer
        experts = layer.ffn.experts
        assert (experts.num_local_experts, experts.expert_start, experts.local_intermediate) == layout
        assert (layer.attn.num_heads, layer.attn.groups, layer.attn.rate) == (2, 1, 4)
        assert layer.e_proj.weight.shape == (64, 64) and layer.hc_head.hc_fn.shape == (2, 128)


def test_checkpoint_names():
    """DeepSeek's names (and under `model.`) land in the MTP layer, named as the target's blocks' are; the
    target's own tensors are not the draft's."""
    mtp = object.__new__(DeepseekV4MTP)  # the mapping needs no weights
    torch.nn.Module.__init__(mtp)
    mtp.tie_word_embeddings = False
    to = mtp.checkpoint_name_to_param
    assert to("mtp.0.attn.kv_norm.weight") == to("model.mtp.0.attn.norm.weight") == ("mtp.0.attn.norm.weight", None)
    assert to("mtp.0.ffn.experts.3.w1.weight") == ("mtp.0.ffn.experts.gate_up_proj", ("gate", 3))
    assert to("mtp.0.ffn.gate.bias") == ("mtp.0.ffn.gate.e_score_correction_bias", None)
    assert to("mtp.0.hc_head_fn") == ("mtp.0.hc_head.hc_fn", None)
    assert to("mtp.0.hc_attn_fn") == ("mtp.0.hc_attn_fn", None)
    assert to("mtp.0.e_proj.weight") == ("mtp.0.e_proj.weight", None)
    assert to("mtp.0.head.weight") == ("mtp.0.head.weight", None)
    assert to("layers.0.attn.wq_a.weight") is None and to("head.weight") is None
    with pytest.raises(ValueError, match="only one MTP layer"):
        to("mtp.1.enorm.weight")


def test_the_layer_type_follows_compress_ratios():
    """DeepSeek's configs list a compress ratio per layer, the MTP layer's after the decoder's: 0 sliding, else the
    type of that rate; a config without it (save_pretrained's) gets a sliding layer; another rate is refused."""
    from types import SimpleNamespace

    tc = SimpleNamespace(num_hidden_layers=2, compress_rates={"compressed_sparse_attention": 4,
                                                              "heavily_compressed_attention": 128})
    assert mtp_layer_type(tc, {}) == mtp_layer_type(tc, {"compress_ratios": [4, 128]}) == "sliding_attention"
    assert mtp_layer_type(tc, {"compress_ratios": [4, 128, 0]}) == "sliding_attention"
    assert mtp_layer_type(tc, {"compress_ratios": [4, 128, 128]}) == "heavily_compressed_attention"
    assert mtp_layer_type(tc, {"compress_ratios": [0, 0, 4]}) == "compressed_sparse_attention"
    with pytest.raises(ValueError, match=r"compress_ratios\[2\]=8"):
        mtp_layer_type(tc, {"compress_ratios": [4, 128, 8]})


def test_a_layer_with_its_own_head_is_refused(tmp_path):
    path = make_tiny_v4_mtp_model(tmp_path / "m", "random", copies=True)
    file = path / "model-mtp.safetensors"
    tensors = load_file(str(file))
    tensors["mtp.0.head.weight"] = tensors["mtp.0.head.weight"] + 1
    save_file(tensors, str(file))
    with pytest.raises(ValueError, match="own head, which differs from the target's"):
        LLM(str(path), speculative_config=mtp_spec(1), **BASE, **ENGINES["plain"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (scripts/h200 v4-model-tests)")
def test_on_cuda(checkpoints):
    """On the GPU, float32 (V4's attention is the host path, eager): greedy identical to no speculation with either
    layer, the copy's drafts accepted, and every draft of the random layer equal to the reference."""
    cuda = {**BASE, **ENGINES["plain"], "device": "cuda", "dtype": "float32", "kv_cache_memory": 1 << 26}
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for kind in ("copy", "random"):
        run = speculate_as_without(checkpoints[kind], 2, params, cuda)
        assert run.proposed > 0 and (run.accepted > run.proposed // 2 or kind == "random")
        if kind == "random":
            with hf_indexer_ties_to_lower_index():
                assert_drafts_equal_the_reference(run.proposals, Reference(checkpoints[kind]))
