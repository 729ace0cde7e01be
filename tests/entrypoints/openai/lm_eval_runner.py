"""Runs lm-evaluation-harness on the two local tasks of lm_eval_data/ (20 multiple-choice questions scored by
log-likelihood, 5 short answers generated until a newline) with one model, and writes the scores and per-item
results as JSON. A process of its own, so that HF_HUB_OFFLINE / HF_DATASETS_OFFLINE hold from the first import.

    lm_eval_runner.py OUT.json local-completions BASE_URL SERVED_NAME TOKENIZER_DIR
    lm_eval_runner.py OUT.json hf MODEL_DIR
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

DATA = Path(__file__).resolve().parent / "lm_eval_data"

MULTIPLE_CHOICE = {
    "task": "surge_multiple_choice",
    "dataset_path": "json",
    "dataset_kwargs": {"data_files": {"test": str(DATA / "multiple_choice.jsonl")}},
    "test_split": "test",
    "output_type": "multiple_choice",
    "doc_to_text": "Question: {{question}}\nAnswer:",
    "doc_to_choice": "choices",
    "doc_to_target": "answer",
    "metric_list": [{"metric": "acc"}, {"metric": "acc_norm"}],
}
GENERATE = {
    "task": "surge_generate",
    "dataset_path": "json",
    "dataset_kwargs": {"data_files": {"test": str(DATA / "generate.jsonl")}},
    "test_split": "test",
    "output_type": "generate_until",
    "doc_to_text": "Q: {{question}}\nA:",
    "doc_to_target": " {{answer}}",
    "generation_kwargs": {"until": ["\n"], "max_gen_toks": 12, "do_sample": False, "temperature": 0.0},
    "metric_list": [{"metric": "exact_match", "ignore_case": True, "ignore_punctuation": True}],
}


def main(out_path: str, model: str, *args: str) -> None:
    import lm_eval

    if model == "local-completions":
        base_url, served_name, tokenizer = args
        model_args = {"base_url": f"{base_url}/v1/completions", "model": served_name, "tokenizer": tokenizer,
                      "tokenizer_backend": "huggingface", "tokenized_requests": True, "num_concurrent": 1,
                      "max_retries": 1, "timeout": 120}
        batch_size = 8  # several prompts per request: the server's batched-prompt path
    else:
        (pretrained,) = args
        model_args = {"pretrained": pretrained, "dtype": "float32", "device": "cpu"}
        batch_size = 1  # no padding in the reference
    results = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[MULTIPLE_CHOICE, GENERATE],
                                      batch_size=batch_size, log_samples=True)
    mc = sorted(results["samples"]["surge_multiple_choice"], key=lambda s: s["doc_id"])
    gen = sorted(results["samples"]["surge_generate"], key=lambda s: s["doc_id"])
    summary = {
        "acc": results["results"]["surge_multiple_choice"]["acc,none"],
        "acc_norm": results["results"]["surge_multiple_choice"]["acc_norm,none"],
        # Per question, per choice: (log-likelihood of the choice given the question, whether it is the greedy one).
        "loglikelihoods": [[list(r) for r in s["filtered_resps"]] for s in mc],
        "exact_match": results["results"]["surge_generate"]["exact_match,none"],
        "generations": [s["filtered_resps"][0] for s in gen],
    }
    Path(out_path).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main(*sys.argv[1:])
