"""bfloat16 and float16 on a CPU without AVX-512 or bf16 instructions, on any machine: a child process with oneDNN
capped at AVX2 (ONEDNN_MAX_CPU_ISA) and torch's dispatch capped at AVX2 (ATEN_CPU_CAPABILITY) runs the default model
greedily in float32, bfloat16 and float16. Uncapped, oneDNN's bf16 weight packing raised at the first step there."""
from __future__ import annotations

import json
import os
import subprocess
import sys

CHILD = r"""
import json, sys
from surge import LLM, SamplingParams
from surge.model.layers import gemm
from surge.model.layers.cpu_caps import cpu_caps

out = {"caps": cpu_caps().describe(), "native_bf16": cpu_caps().native_bf16, "aten": cpu_caps().aten}
params = SamplingParams(temperature=0, max_tokens=16, min_tokens=16)
for dtype in ("float32", "bfloat16", "float16"):
    llm = LLM(sys.argv[1], dtype=dtype, max_model_len=128, kv_cache_memory=16 << 20)
    out[dtype] = llm.generate(["The capital of France is"], params, use_tqdm=False)[0].outputs[0].token_ids
    del llm
out["paths"] = {str(d): p for d, p in gemm._PATHS.items()}
print("RESULT " + json.dumps(out))
"""


def test_half_precision_on_an_avx2_cpu(default_model_dir):
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
    proc = subprocess.run([sys.executable, "-c", CHILD, str(default_model_dir)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert result["aten"] == "AVX2" and not result["native_bf16"], result["caps"]
    assert result["paths"]["torch.bfloat16"] in ("onednn_fp32", "torch"), result  # never packed bf16 under the cap
    assert "CPU GEMM for bfloat16" in proc.stderr  # the choice is said in the log
    assert len(result["float32"]) == 16
    # a prompt on which the two agree: the same greedy tokens in every dtype
    assert result["bfloat16"] == result["float32"]
    assert result["float16"] == result["float32"]
