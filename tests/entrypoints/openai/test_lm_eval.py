"""lm-evaluation-harness (lm-eval from PyPI) through `surge serve`, against lm-eval's own `hf` model on the same
checkpoint (the default model, float32): its `local-completions` model scores 20 multiple-choice questions by
log-likelihood (echo + logprobs) and generates 5 short answers (generate_until), from local data (lm_eval_data/);
nothing is fetched from a hub. Accuracy must be equal, every log-likelihood within 1e-3, the generations identical.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from remote_server import RemoteServer

RUNNER = Path(__file__).with_name("lm_eval_runner.py")
SERVED_NAME = "SmolLM2-135M-Instruct"
MAX_LOGLIKELIHOOD_DIFF = 1e-3


def run_lm_eval(tmp: Path, model: str, *args: str) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_DATASETS_CACHE": str(tmp / "datasets"),
           "TOKENIZERS_PARALLELISM": "false", "OPENAI_API_KEY": "none"}
    out = tmp / f"{model}.json"
    subprocess.run([sys.executable, str(RUNNER), str(out), model, *args], env=env, check=True, timeout=600)
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def results(default_model_dir, tmp_path_factory) -> tuple[dict, dict]:
    """(through Surge, lm-eval's hf model)"""
    tmp = tmp_path_factory.mktemp("lm-eval")
    with RemoteServer(None, "--dtype", "float32", "--max-model-len", "2048", "--kv-cache-memory",
                      str(256 << 20)) as server:
        surge = run_lm_eval(tmp, "local-completions", server.url, SERVED_NAME, str(default_model_dir))
    return surge, run_lm_eval(tmp, "hf", str(default_model_dir))


def test_loglikelihood_accuracy_equals_hf(results):
    surge, hf = results
    print(f"\nlm-eval multiple choice (20 questions): acc {surge['acc']:.4f} via Surge, {hf['acc']:.4f} via hf; "
          f"acc_norm {surge['acc_norm']:.4f} via Surge, {hf['acc_norm']:.4f} via hf")
    assert (surge["acc"], surge["acc_norm"]) == (hf["acc"], hf["acc_norm"])


def test_per_item_loglikelihoods_agree(results):
    surge, hf = results
    assert len(surge["loglikelihoods"]) == len(hf["loglikelihoods"]) == 20
    diffs = []
    for question, (ours, theirs) in enumerate(zip(surge["loglikelihoods"], hf["loglikelihoods"])):
        assert len(ours) == len(theirs) == 4, question
        for (ll, greedy), (ref_ll, ref_greedy) in zip(ours, theirs):
            diffs.append(abs(ll - ref_ll))
            assert greedy == ref_greedy, question
    print(f"\nlm-eval per-item log-likelihoods: max |Surge - hf| = {max(diffs):.2e} over {len(diffs)} choices")
    assert max(diffs) < MAX_LOGLIKELIHOOD_DIFF


def test_generate_until_through_the_server(results):
    surge, hf = results
    print(f"\nlm-eval generate_until (5 questions): exact_match {surge['exact_match']:.2f} via Surge, "
          f"{hf['exact_match']:.2f} via hf; generations {surge['generations']}")
    assert surge["generations"] == hf["generations"]
    assert surge["exact_match"] == hf["exact_match"]
    assert all("\n" not in g for g in surge["generations"])  # `until` was honoured
