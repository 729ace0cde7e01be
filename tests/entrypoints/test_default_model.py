"""The embedded default model end to end: greedy output token-identical to HF transformers on the same converted
directory, the chat template rendered exactly as HF renders it, and the CLI answering a question."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from surge import LLM, SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
    "Q: What is 12 times 7?\nA:",
    "Water boils at a temperature of",
    "Translate to French: Good morning, how are you?\n",
    "A haiku about autumn leaves:\n",
]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Name a fruit."}],
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Tell me a fact about the moon."}],
]


@pytest.fixture(scope="module")
def llm(default_model_dir):
    return LLM(default_model_dir, dtype="float32", max_model_len=1024, kv_cache_memory=256 << 20)


@pytest.fixture(scope="module")
def hf(default_model_dir):
    return (AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval(),
            AutoTokenizer.from_pretrained(default_model_dir))


def test_greedy_matches_hf(llm, hf):
    """HF's greedy continuation is checked token by token in one forward pass per prompt (teacher forcing): Surge's
    tokens are HF's greedy generation exactly when each is HF's argmax after the prompt and the tokens before it
    (64 incremental `generate` steps per prompt cost ~5x more). EOS is masked there as min_new_tokens=64 masks it;
    `generate` itself, on the first prompt, must agree with this reference."""
    model, tokenizer = hf
    chat_prompts = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in CHATS[:2]]
    prompts = PROMPTS + chat_prompts
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=64, min_tokens=64), use_tqdm=False)
    eos = model.generation_config.eos_token_id
    with torch.inference_mode():
        for i, (prompt, out) in enumerate(zip(prompts, outs)):  # one at a time: no padding in the reference
            tokens = list(out.outputs[0].token_ids)
            assert len(tokens) == 64, prompt
            ids = torch.tensor([out.prompt_token_ids + tokens])
            # logits at the prompt's last position and at each generated one but the last: the next token's
            logits = model(ids, logits_to_keep=len(tokens) + 1).logits[0, :-1]
            logits[:, eos] = float("-inf")
            ref = logits.argmax(-1)
            if i == 0:
                prompt_ids = ids[:, :len(out.prompt_token_ids)]
                generated = model.generate(prompt_ids, max_new_tokens=64, min_new_tokens=64, do_sample=False)
                assert generated[0, prompt_ids.shape[1]:].tolist() == ref.tolist()
            assert tokens == ref.tolist(), prompt
            assert out.outputs[0].text == tokenizer.decode(ref, skip_special_tokens=True)
    assert out.prompt_token_ids == tokenizer.encode(prompt)


def test_chat_template_renders_like_hf(llm, hf):
    _, tokenizer = hf
    for conversation in CHATS:
        for gen_prompt in (True, False):
            expected = tokenizer.apply_chat_template(conversation, tokenize=True, add_generation_prompt=gen_prompt,
                                                     return_dict=True)["input_ids"]
            assert llm.render_chat(conversation, add_generation_prompt=gen_prompt) == list(expected)


def test_chat_answers_paris(llm):
    out = llm.chat(CHATS[0], SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0].outputs[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"  # the model ends its turn with <|im_end|>, an EOS id


def test_cli_chat_and_generate(default_model_dir):
    run = [sys.executable, "-m", "surge.entrypoints.cli.main"]
    path = subprocess.run(run + ["model-path"], capture_output=True, text=True, timeout=300, check=True)
    assert path.stdout.strip() == str(default_model_dir)
    chat = subprocess.run(run + ["chat", "What is the capital of France?", "--temperature", "0", "--max-tokens", "32"],
                          capture_output=True, text=True, timeout=300)
    assert chat.returncode == 0, chat.stderr
    assert "Paris" in chat.stdout
    bad = subprocess.run(run + ["generate", "hi", "--top-p", "5"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "top_p" in bad.stderr
