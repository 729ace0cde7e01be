"""A tokenizer with DeepSeek's marker tokens, for tests of DeepSeek's prompt and output formats without a hub: the
tiny models' byte vocabulary (newlines included) with each marker one token (ids 200 up, inside the tiny models'
256-token vocabulary), matched whole as DeepSeek's added tokens are, and not special, as theirs are not."""
from __future__ import annotations

from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from tiny_models import VOCAB

MARKERS = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>",
           "｜DSML｜", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
           "<｜tool▁sep｜>")
_FIRST_MARKER_ID = 200


def deepseek_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {f"<{i}>": i for i in range(VOCAB)}
    for b in [10, *range(32, 127)]:
        vocab.pop(f"<{b}>")
        vocab[chr(b)] = b
    for i, marker in enumerate(MARKERS):
        vocab.pop(f"<{_FIRST_MARKER_ID + i}>")
        vocab[marker] = _FIRST_MARKER_ID + i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<0>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    tok.add_tokens([AddedToken(m, special=False, normalized=False) for m in MARKERS])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<0>", bos_token=MARKERS[0], eos_token=MARKERS[1])


def with_deepseek_tokenizer(model_dir: Path, chat_template: str | None = None) -> Path:
    tokenizer = deepseek_tokenizer()
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(model_dir)
    return model_dir
