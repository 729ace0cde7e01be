"""`surge bench embed` runs end to end on CPU, beside sentence-transformers on the same weights and inputs: a
sentence-transformers directory (the peer loads it itself) and a random-weight preset (the peer takes its weights)."""
from __future__ import annotations

import re

from surge.entrypoints.cli.main import main
from tiny_pooling import save_tiny_embedding


def check_report(out: str, peer: str) -> None:
    assert re.search(r"surge: .* texts/s .* tok/s .* TFLOP/s \(MFU .*%\)", out)
    assert re.search(rf"{re.escape(peer)} \(batch 4\): .* texts/s .* tok/s", out)
    cosine = float(re.search(r"smallest cosine between their embeddings ([0-9.]+)", out).group(1))
    assert cosine >= 0.9999


def test_bench_embed_beside_sentence_transformers(tmp_path, capsys):
    path = save_tiny_embedding(tmp_path / "mean", "mean", normalize=True)
    assert main(["bench", "embed", "--model", str(path), "--num-prompts", "8", "--input-len", "10",
                 "--input-len-max", "60", "--st-batch-size", "4", "--max-model-len", "128",
                 "--max-num-batched-tokens", "64"]) == 0
    check_report(capsys.readouterr().out, "sentence-transformers")


def test_bench_embed_on_a_preset(capsys):
    assert main(["bench", "embed", "--preset", "tiny-llama", "--num-prompts", "6", "--input-len", "16",
                 "--st-batch-size", "4", "--max-model-len", "128"]) == 0
    check_report(capsys.readouterr().out, "hf + st Pooling/Normalize")
