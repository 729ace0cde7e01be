"""DeepSeek-V3's MTP layer as the draft (speculative_config method "deepseek_mtp") on tiny V3 checkpoints that ship one
(tests/tiny_dsv.py): every draft equals a plain reference built from HF's own DeepSeek-V3 modules and hidden states
(through rejections, chunked prefill and preemption, k = 1 and recurrent k = 3), greedy output is identical to
decoding without speculation, a layer that copies the target's is accepted, and expert parallelism reaches it."""
from __future__ import annotations

import pytest
import torch
from mtp_checks import (assert_drafts_equal_the_reference, draft_as_rank_1_of_2, mtp_spec, one_rank_and_two,
                        speculate_as_without)
from safetensors.torch import load_file, save_file
from tiny_dsv import make_tiny_mtp_model
from tiny_models import make_tiny_model
from transformers import AutoModelForCausalLM
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

from surge import LLM, SamplingParams
from surge.model.models.deepseek_mtp import DeepseekMTP

BASE = {"block_size": 4, "max_model_len": 128, "device": "cpu"}
ENGINES = {"plain": {"kv_cache_memory": 1 << 22},
           "preempted-chunked": {"num_gpu_blocks_override": 40, "max_num_batched_tokens": 16}}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {"copy": make_tiny_mtp_model(tmp_path_factory.mktemp("copy"), "copy"),
            "random": make_tiny_mtp_model(tmp_path_factory.mktemp("random"), "random", copies=True)}


class Reference:
    """The MTP draft computed plainly: HF's final hidden states of the target, then eh_proj([enorm(embed(next
    token)) ; hnorm(h)]) (position 0's embedding zeroed), HF's DeepseekV3DecoderLayer holding the checkpoint's
    MTP block, shared_head.norm and the LM head; pass j > 1 feeds draft j - 1 and the pass before's output."""

    def __init__(self, path) -> None:
        self.hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        config = self.hf.config
        w = {n.removeprefix("model.layers.1."): t for n, t in load_file(str(path / "model-mtp.safetensors")).items()}
        self.block = DeepseekV3DecoderLayer(config, layer_idx=1).eval()
        self.block.load_state_dict({n: t for n, t in w.items()
                                    if not n.startswith(("enorm", "hnorm", "eh_proj", "shared_head", "embed"))})
        self.w, self.eps = w, config.rms_norm_eps

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.w[f"{name}.weight"]

    def _block(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        pos = torch.arange(t)[None]
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        return self.block(x[None], attention_mask=mask, position_ids=pos,
                          position_embeddings=self.hf.model.rotary_emb(x[None], pos))[0]

    @torch.no_grad()
    def drafts(self, tokens: list[int], k: int) -> tuple[list[int], list[float]]:
        """The k drafts after tokens (its newest not yet through the target), and each one's top-2 logit margin."""
        m = len(tokens) - 1
        h = self.hf.model(torch.tensor([tokens[:m]])).last_hidden_state[0]  # positions 0 .. m-1
        embed = self.hf.model.embed_tokens(torch.tensor(tokens[1:]))
        embed[0] = 0  # position 0
        xs = [torch.cat((self._norm(embed, "enorm"), self._norm(h, "hnorm")), -1) @ self.w["eh_proj.weight"].T]
        drafts, margins = [], []
        for _ in range(k):
            g = self._block(torch.cat(xs))[-1]
            logits = self.hf.lm_head(self._norm(g, "shared_head.norm"))
            top = logits.topk(2)
            drafts.append(int(top.indices[0]))
            margins.append(float(top.values[0] - top.values[1]))
            e = self.hf.model.embed_tokens(torch.tensor([drafts[-1]]))
            xs.append(torch.cat((self._norm(e, "enorm"), self._norm(g[None], "hnorm")), -1) @ self.w["eh_proj.weight"].T)
        return drafts, margins


@pytest.mark.parametrize(("k", "engine"), [(1, "plain"), (3, "plain"), (3, "preempted-chunked")])
def test_drafts_equal_the_reference(checkpoints, k, engine):
    """The random MTP layer's drafts are mostly rejected: the step forward's rows past the accepted position are
    junk, rewritten by the next step, and every proposal must still equal the reference's from the whole
    sequence. The checkpoint ships the layer's own embed_tokens and shared_head.head, equal to the target's."""
    path = checkpoints["random"]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    run = speculate_as_without(path, k, params, {**BASE, **ENGINES[engine]})
    if engine == "preempted-chunked":
        assert run.llm.engine.scheduler.num_preemptions > 0
    assert len(run.proposals) > 20
    assert_drafts_equal_the_reference(run.proposals, Reference(path))


@pytest.mark.parametrize(("k", "engine"), [(1, "plain"), (3, "plain"), (3, "preempted-chunked"), (2, "async")])
def test_greedy_identical_and_a_copy_of_the_target_layer_accepted(checkpoints, k, engine):
    path = checkpoints["copy"]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    extra = {"async_scheduling": True, **ENGINES["plain"]} if engine == "async" else ENGINES[engine]
    run = speculate_as_without(path, k, params, {**BASE, **extra})
    proposed, accepted = run.proposed, run.accepted
    print(f"deepseek_mtp k={k} {engine}: {accepted}/{proposed} drafts accepted ({accepted / proposed:.0%})")
    assert proposed > 0 and accepted > 0
    assert run.llm.engine.kv_cache_manager.usage == 0.0
    assert (run.ahead > 0) == (engine == "async")
    stats = run.llm.engine.scheduler.spec_stats
    assert stats.num_drafts > 0 and stats.acceptance_rate > 0


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2", "tp2-ep"])
def test_two_ranks_propose_as_one(checkpoints, expert_parallel):
    """TP=2 (gloo), the MTP layer's heads split like the target's and, with expert parallelism, its experts: the
    same output and the same drafts accepted as on one rank (a draft whose experts were split otherwise than the
    process's groups say would be summed wrongly, and propose otherwise)."""
    path = checkpoints["random"]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    (one, counts_one), (two, counts_two) = one_rank_and_two(path, 2, params, expert_parallel,
                                                            {**BASE, **ENGINES["plain"]})
    assert [o.outputs[0].token_ids for o in two] == [o.outputs[0].token_ids for o in one]
    assert counts_two == counts_one and counts_one[0] > 0


def test_the_draft_splits_its_experts_as_the_target(checkpoints):
    """Built as rank 1 of two under the draft's ParallelConfig (derived by DRAFT_PARALLEL_POLICY, which inherits
    expert parallelism): with it the MTP block holds experts 4..7 of 8, whole; without, half of each of the 8."""
    for ep, layout in ((True, (4, 4, 32)), (False, (8, 0, 16))):
        model = draft_as_rank_1_of_2(checkpoints["random"], ep, DeepseekMTP)
        experts = model.layer.mtp_block.mlp.experts
        assert (experts.num_local_experts, experts.expert_start, experts.local_intermediate) == layout


def test_a_layer_with_its_own_head_is_refused(tmp_path):
    path = make_tiny_mtp_model(tmp_path / "m", "random", copies=True)
    file = path / "model-mtp.safetensors"
    tensors = load_file(str(file))
    tensors["model.layers.1.shared_head.head.weight"] = tensors["model.layers.1.shared_head.head.weight"] + 1
    save_file(tensors, str(file))
    with pytest.raises(ValueError, match="own shared_head.head, which differs from the target's"):
        LLM(str(path), speculative_config=mtp_spec(1), **BASE, **ENGINES["plain"])


@pytest.mark.parametrize(("kind", "spec", "match"), [
    ("llama", {}, "LlamaForCausalLM has none"),
    ("deepseek-v3", {}, "num_nextn_predict_layers=0"),
    ("mtp", {"draft_tensor_parallel_size": 1}, "runs on the target's ranks"),
    ("mtp", {"model": "/elsewhere"}, "reads the target's own checkpoint"),
])
def test_refused_by_name(tmp_path, kind, spec, match):
    if kind == "llama":
        path = make_tiny_model("llama", tmp_path / "m")
    elif kind == "deepseek-v3":
        from tiny_dsv import make_tiny_model as make_dsv
        path = make_dsv("deepseek-v3", tmp_path / "m")
    else:
        path = make_tiny_mtp_model(tmp_path / "m", "random")
    with pytest.raises(ValueError, match=match):
        LLM(str(path), speculative_config={**mtp_spec(1), **spec}, **BASE, **ENGINES["plain"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (scripts/h200 spec-tests)")
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_on_cuda(checkpoints, async_scheduling):
    """On the GPU, float32: greedy identical and the copy accepted; synchronously, every draft of the random layer
    equals the reference (under async scheduling the drafts stay on the device, verified before the host sees
    them)."""
    cuda = {**BASE, "device": "cuda", "dtype": "float32", "kv_cache_memory": 1 << 26,
            "async_scheduling": async_scheduling}
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    for kind in ("copy", "random"):
        run = speculate_as_without(checkpoints[kind], 3, params, cuda)
        assert run.proposed > 0 and (run.accepted > 0 or kind == "random")
        assert bool(run.proposals) != async_scheduling
        assert_drafts_equal_the_reference(run.proposals, Reference(checkpoints[kind]))
