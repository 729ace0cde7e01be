"""A model directory `surge serve` can load from a preset: its random weights (surge's preset checkpoint writer)
and a word-level tokenizer with one token per id of the model's vocabulary, so every generated id detokenizes.
For GPU benchmarks of serving (tests/disagg/h200_pd.sh), where no real checkpoint or hub is at hand.

    python3 tests/disagg/preset_server_dir.py PRESET DTYPE DIR
"""
from __future__ import annotations

import json
import sys

import torch
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

from surge.model.loader.preset_checkpoint import write_preset_checkpoint


def main(preset: str, dtype: str, out_dir: str) -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    path = write_preset_checkpoint(preset, out_dir, dtype, device)
    if (path / "tokenizer.json").exists():
        return
    config = json.loads((path / "config.json").read_text())
    vocab = {f"<{i}>": i for i in range(config["vocab_size"])}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<0>"))
    eos = config.get("eos_token_id", 2)
    eos = eos[0] if isinstance(eos, list) else eos
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<0>", eos_token=f"<{eos}>").save_pretrained(path)
    print(f"{path}: {preset} ({dtype}) with a {len(vocab)}-token word-level tokenizer")


if __name__ == "__main__":
    main(*sys.argv[1:4])
