"""A new engine process for tests/kv_transfer/test_mooncake_store.py: reads {"model", "engine", "prompts",
"params"} as JSON on stdin, generates, and prints one line `RESULT <json>`: token ids, cached prompt tokens and the
KV connector's counters."""
from __future__ import annotations

import json
import sys

from surge import LLM, SamplingParams


def main() -> None:
    spec = json.loads(sys.stdin.read())
    llm = LLM(spec["model"], **spec["engine"])
    outs = llm.generate([{"prompt_token_ids": p} for p in spec["prompts"]], SamplingParams(**spec["params"]),
                        use_tqdm=False)
    connector = llm.engine.kv_connector
    print("RESULT " + json.dumps({"tokens": [o.outputs[0].token_ids for o in outs],
                                  "num_cached_tokens": [o.num_cached_tokens for o in outs],
                                  "stats": vars(connector.stats) if connector is not None else None,
                                  "failed_loads": llm.engine.scheduler.num_failed_kv_loads}), flush=True)


if __name__ == "__main__":
    main()
