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


def start_lm_eval(tmp: Path, model: str, *args: str) -> tuple[subprocess.Popen, Path]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_DATASETS_CACHE": str(tmp / model),
           "TOKENIZERS_PARALLELISM": "false", "OPENAI_API_KEY": "none"}
    out = tmp / f"{model}.json"
    return subprocess.Popen([sys.executable, str(RUNNER), str(out), model, *args], env=env), out


def finish_lm_eval(run: tuple[subprocess.Popen, Path]) -> dict:
    proc, out = run
    try:
        assert proc.wait(timeout=600) == 0, f"lm_eval_runner.py exited with {proc.returncode}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def results(default_model_dir, tmp_path_factory) -> tuple[dict, dict]:
    """(through Surge, lm-eval's hf model). The two runs are independent: the hf one runs beside the server's
    start-up and the Surge run (each mostly one busy thread on a 2-core machine) instead of after them."""
    tmp = tmp_path_factory.mktemp("lm-eval")
    hf = start_lm_eval(tmp, "hf", str(default_model_dir))
    try:
        with RemoteServer(None, "--dtype", "float32", "--max-model-len", "2048", "--kv-cache-memory",
                          str(256 << 20)) as server:
            surge = finish_lm_eval(start_lm_eval(tmp, "local-completions", server.url, SERVED_NAME,
                                                 str(default_model_dir)))
    except BaseException:
        hf[0].kill()
        hf[0].wait()
        raise
    return surge, finish_lm_eval(hf)


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
