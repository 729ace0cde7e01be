"""Rotary tables for every rope type transformers defines: cos/sin equal HF's own rotary embedding's output as its
cached greedy generate calls it (prompt, then one position per step; within and beyond the scaling threshold),
partial rotary, per-layer-type rope (Gemma 3), the meta-device build, errors by name; and HF parity of tiny Llama /
Qwen3 models with yarn, linear, dynamic and longrope rope."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig, GPTNeoXConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding
from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXRotaryEmbedding
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from surge import LLM, SamplingParams
from surge.model.layers.rotary import RotaryEmbedding, rope_parameters, supported_rope_types
from hf_parity import ATOL, RTOL, check_all, record_logits
from tiny_rope import HEAD_DIM, ROPE_PARAMS, THRESHOLD, make_tiny_rope_model, rope_config

NUM_POSITIONS = 80  # well past the threshold of 32


def hf_generate_tables(rotary, prompt_lens: list[int], num_positions: int, **kwargs):
    """What HF's rotary embedding returns for positions 0..num_positions-1 as generate calls it: the prompt in one
    forward, then one position per step. Several sequences in turn through the same module (its dynamic state
    carries over, as between generate calls); per sequence, the first row to compare and the tables [num_positions, D].
    A prompt past the threshold runs in one forward with the frequencies of its whole length, where Surge keeps each
    position's own (the module docstring of surge/model/layers/rotary.py): only its generated positions compare."""
    x = torch.zeros(1)
    tables = []
    for prompt_len in prompt_lens:
        cos, sin = rotary(x, torch.arange(prompt_len)[None], **kwargs)
        rows = [(cos[0], sin[0])]
        for p in range(prompt_len, num_positions):
            cos, sin = rotary(x, torch.tensor([[p]]), **kwargs)
            rows.append((cos[0], sin[0]))
        first = 0 if prompt_len < THRESHOLD else prompt_len
        tables.append((first, torch.cat([c for c, _ in rows]), torch.cat([s for _, s in rows])))
    return tables


def assert_tables_equal(rope: RotaryEmbedding, first: int, cos: torch.Tensor, sin: torch.Tensor, msg: str) -> None:
    """HF's [N, D] (the half-table twice, rotate-half layout) against Surge's [N, D / 2], from row `first`."""
    half = cos.shape[-1] // 2
    assert rope.cos_cache.shape == (NUM_POSITIONS, half), msg
    torch.testing.assert_close(cos[:, half:], cos[:, :half], rtol=0, atol=0)
    # Same init functions, same float32 ops: equal to the last bit, except dynamic's scaled rows, computed for all
    # lengths in one call where HF makes one per step (its pow runs vectorized or scalar by tensor size and CPU, so
    # even HF's own last bits vary); an inv_freq a last place off moves the angle at position p by ~p ulps.
    tol = dict(rtol=0, atol=1e-5) if "dynamic" in msg else dict(rtol=0, atol=0)
    torch.testing.assert_close(rope.cos_cache[first:], cos[first:, :half], **tol, msg=msg)
    torch.testing.assert_close(rope.sin_cache[first:], sin[first:, :half], **tol, msg=msg)


def test_every_hf_rope_type_has_a_tiny_config():
    assert set(supported_rope_types()) == {"default", *ROPE_INIT_FUNCTIONS} <= set(ROPE_PARAMS)


@pytest.mark.parametrize("rope_type", list(ROPE_PARAMS))
def test_tables_match_hf_rotary_embedding(rope_type):
    config = rope_config("llama", rope_type)
    rope = RotaryEmbedding(HEAD_DIM, NUM_POSITIONS, rope_parameters(config, "full_attention"))
    hf = LlamaRotaryEmbedding(config)
    # A prompt past the threshold (on a fresh module: HF keeps the longest sequence's dynamic frequencies for a later
    # one that starts past it), then short ones, for which HF resets dynamic's frequencies to the original ones.
    for first, cos, sin in hf_generate_tables(hf, [THRESHOLD + 9, 5, 12], NUM_POSITIONS):
        assert_tables_equal(rope, first, cos, sin, rope_type)
    if rope_type in ("yarn", "longrope"):
        assert rope.attention_factor > 1.2
    if rope_type in ("dynamic", "longrope"):  # the scaled frequencies differ from the original ones
        assert not torch.allclose(rope.cos_cache[THRESHOLD + 5], torch.cos((THRESHOLD + 5) * hf.original_inv_freq))


def test_partial_rotary_factor_is_honoured():
    neox = GPTNeoXConfig(hidden_size=64, num_attention_heads=4, partial_rotary_factor=0.25)
    rope = RotaryEmbedding(16, NUM_POSITIONS, rope_parameters(neox))
    assert rope.rotary_dim == 4
    [(first, cos, sin)] = hf_generate_tables(GPTNeoXRotaryEmbedding(neox), [NUM_POSITIONS], NUM_POSITIONS)
    assert_tables_equal(rope, first, cos, sin, "default, partial")
    for rope_type in ("yarn", "dynamic", "longrope"):
        overrides = {"partial_rotary_factor": 0.5}
        if rope_type == "longrope":  # one factor per rotated frequency
            overrides |= {k: ROPE_PARAMS[rope_type][k][:HEAD_DIM // 4] for k in ("short_factor", "long_factor")}
        config = rope_config("llama", rope_type, **overrides)
        rope = RotaryEmbedding(HEAD_DIM, NUM_POSITIONS, rope_parameters(config))
        assert rope.rotary_dim == HEAD_DIM // 2
        [(first, cos, sin)] = hf_generate_tables(LlamaRotaryEmbedding(config), [7], NUM_POSITIONS)
        assert_tables_equal(rope, first, cos, sin, f"{rope_type}, partial")


def test_per_layer_type_rope_gemma3():
    config = Gemma3TextConfig(hidden_size=64, num_attention_heads=4, head_dim=HEAD_DIM, num_hidden_layers=2,
                              layer_types=["sliding_attention", "full_attention"],
                              rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                               "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                  "rope_theta": 1000000.0}})
    hf = Gemma3RotaryEmbedding(config)
    for layer_type in config.layer_types:
        rope = RotaryEmbedding(HEAD_DIM, NUM_POSITIONS, rope_parameters(config, layer_type))
        [(first, cos, sin)] = hf_generate_tables(hf, [NUM_POSITIONS], NUM_POSITIONS, layer_type=layer_type)
        assert_tables_equal(rope, first, cos, sin, layer_type)


@pytest.mark.parametrize("rope_type", ["default", "yarn", "dynamic", "longrope", "proportional"])
def test_meta_build_has_the_shapes_only(rope_type):
    params = rope_parameters(rope_config("llama", rope_type))
    with torch.device("meta"):
        meta = RotaryEmbedding(HEAD_DIM, NUM_POSITIONS, params)
    real = RotaryEmbedding(HEAD_DIM, NUM_POSITIONS, params)
    assert meta.cos_cache.is_meta and meta.cos_cache.shape == real.cos_cache.shape
    assert meta.rotary_dim == real.rotary_dim


def test_unknown_rope_type_and_missing_parameters_are_named():
    with pytest.raises(ValueError, match=r"rope_parameters.rope_type='mystery'.*supported: default, linear, dynamic, "
                                         r"yarn, longrope, llama3"):
        RotaryEmbedding(HEAD_DIM, 64, {"rope_type": "mystery", "rope_theta": 10000.0})
    for rope_type, missing in [("yarn", "factor"), ("longrope", "long_factor"), ("llama3", "low_freq_factor"),
                               ("dynamic", "max_position_embeddings"), ("linear", "factor")]:
        params = rope_parameters(rope_config("llama", rope_type))
        del params[missing]
        with pytest.raises(ValueError, match=f"rope_parameters.{missing} is required for rope_type='{rope_type}'"):
            RotaryEmbedding(HEAD_DIM, 64, params)


def test_default_table_is_unchanged():
    """The plain rope table, bit for bit as before the init functions (weight caches hold these tables)."""
    rope = RotaryEmbedding(64, 4096, {"rope_theta": 100000.0, "rope_type": "default"})
    inv_freq = 1.0 / (100000.0 ** (torch.arange(0, 64, 2, dtype=torch.int64).float() / 64))
    freqs = torch.outer(torch.arange(4096, dtype=torch.float32), inv_freq)
    assert torch.equal(rope.cos_cache, freqs.cos()) and torch.equal(rope.sin_cache, freqs.sin())


# ---- HF parity of whole models ----

@pytest.fixture(scope="module")
def tiny_rope_model(request, tmp_path_factory):
    family, rope_type = request.param
    name = f"{family}-{rope_type}"
    path = make_tiny_rope_model(family, rope_type, tmp_path_factory.mktemp(name))
    return name, path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _ids(param) -> str:
    return "-".join(param)


@pytest.mark.parametrize("tiny_rope_model", [("llama", "yarn"), ("qwen3", "yarn"), ("llama", "linear")],
                         indirect=True, ids=_ids)
def test_length_independent_rope_matches_hf(tiny_rope_model):
    """Yarn and linear frequencies do not depend on the sequence length: HF's one-shot forward is the reference."""
    check_all(*tiny_rope_model)


def check_against_hf_generate(name: str, path, hf, budget: int, max_tokens: int = 40) -> None:
    """Surge's greedy tokens, logits and logprobs against HF's cached greedy generate, token by token.

    For rope whose frequencies depend on the sequence length (dynamic, longrope), HF's one-shot forward over a whole
    sequence (what hf_parity.check_all compares against) rotates every position with the frequencies of the full
    length, while its own generate rotates each new token with those of the length so far: the two differ past the
    threshold, and Surge follows generate (see surge/model/layers/rotary.py). So the reference is HF's generate, one
    prompt at a time, without padding. Prompts stay below the threshold (32): HF runs a prompt in one forward, with
    the frequencies of its whole length, and resets dynamic's frequencies only for a shorter sequence."""
    llm = LLM(path, dtype="float32", block_size=4, kv_cache_memory=1 << 22, max_num_batched_tokens=budget,
              max_model_len=256)
    records = record_logits(llm)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (3, 13, 29, 31)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=1),
                        use_tqdm=False)
    rows = {(rid, pos): row for rid, pos, row in records}
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                              output_logits=True, return_dict_in_generate=True, pad_token_id=0)
        tokens = out.outputs[0].token_ids
        assert tokens == ref.sequences[0, len(prompt):].tolist(), f"{name}: greedy tokens differ from HF generate"
        logits = torch.cat(ref.logits)  # the raw logits of each step, before min_new_tokens masks eos
        logprobs = torch.log_softmax(logits, -1)
        for j, token in enumerate(tokens):
            pos = len(prompt) - 1 + j
            torch.testing.assert_close(rows[out.request_id, pos], logits[j], atol=ATOL, rtol=RTOL,
                                       msg=f"{name} prompt of {len(prompt)} pos {pos}")
            assert out.outputs[0].logprobs[j][token].logprob == pytest.approx(logprobs[j, token].item(), abs=1e-4)


@pytest.mark.parametrize("budget", [4096, 7])
@pytest.mark.parametrize("tiny_rope_model", [("llama", "dynamic"), ("qwen3", "dynamic"), ("llama", "longrope")],
                         indirect=True, ids=_ids)
def test_length_dependent_rope_matches_hf_generate(tiny_rope_model, budget):
    check_against_hf_generate(*tiny_rope_model, budget=budget)
