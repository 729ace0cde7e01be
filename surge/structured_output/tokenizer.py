"""The tokenizer bridge: the HF tokenizer the engine serves with, as llguidance's LLTokenizer (built once per engine,
~0.3-1 s: llguidance walks every token's bytes into its trie)."""
from __future__ import annotations

import llguidance


class _DecodedTokens:
    """The fallback for tokenizers llguidance's Rust side cannot read (a decoder it does not know): each token's bytes
    are its own decoding, which holds for tokenizers whose tokens decode independently (word- and character-level)."""

    def __init__(self, hf_tokenizer, eos: list[int]) -> None:
        self._hf = hf_tokenizer
        self.eos_token_id = eos[0]
        self.bos_token_id = hf_tokenizer.bos_token_id
        self.special_token_ids = list(hf_tokenizer.all_special_ids)
        self.tokens = [hf_tokenizer.decode([i]).encode() for i in range(len(hf_tokenizer))]

    def __call__(self, text: str) -> list[int]:
        return self._hf.encode(text, add_special_tokens=False)


def ll_tokenizer(hf_tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]) -> llguidance.LLTokenizer:
    """hf_tokenizer over the model's vocabulary: masks have one bit per logit (ids past the tokenizer's own tokens, a
    model's padding rows, are never allowed), and a grammar that has ended allows exactly the model's EOS ids."""
    # The model's EOS ids the tokenizer knows; else (a benchmark pairing a preset with another model's tokenizer)
    # the tokenizer's own.
    eos = [t for t in eos_token_ids if t < len(hf_tokenizer)]
    eos = eos or ([hf_tokenizer.eos_token_id] if hf_tokenizer.eos_token_id is not None else [])
    if not eos:
        raise ValueError("structured output needs an EOS token to end a finished grammar with, and neither the "
                         "model's generation config nor its tokenizer names one")
    if len(hf_tokenizer) > vocab_size:  # a mask could then allow only ids the model has no logits for
        raise ValueError(f"the tokenizer has {len(hf_tokenizer)} tokens, more than the model's vocab_size="
                         f"{vocab_size}: structured output needs the model's own tokenizer")
    n_vocab = vocab_size
    import llguidance.hf  # imports transformers (~1 s): only once a constrained request needs the tokenizer

    try:
        return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=n_vocab, eos_token=eos)
    except ValueError as e:
        if "decoder" not in str(e) and "pre_tokenizer" not in str(e):
            raise ValueError(f"structured output cannot use the tokenizer {type(hf_tokenizer).__name__}: {e}") from None
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_DecodedTokens(hf_tokenizer, eos)), n_vocab=n_vocab,
                                  eos_token=eos)
