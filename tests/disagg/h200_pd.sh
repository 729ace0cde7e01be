#!/usr/bin/env bash
# Issue 16's GPU comparison, run from the repo root on the H200 machine: qwen3-8b, 1 prefill + 1 decode instance
# (MODE=disagg) against 2 independent instances (MODE=colocated), both behind `surge proxy`, on one mixed workload:
# short requests decoding while long prompts arrive among them, two `surge bench serve` runs at once. The short
# ones' TPOT p99 and goodput under TTFT/TPOT targets are the figures to compare.
#   tests/disagg/h200_pd.sh disagg|colocated [GPUS]   GPUS=2: one H200 per instance (default); 1: both on GPU 0
# Results: $OUT/<mode>-<gpus>gpu-{short,long}.json and the instances' logs.
set -uo pipefail
MODE=${1:?disagg or colocated}; GPUS=${2:-2}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=${PYTHONPATH:-$PWD}
# As scripts/h200: wheels from .whl/, and Debian's RDMA libraries (Mooncake's wheel links them) from .debs/.
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
if ls .debs/*.deb >/dev/null 2>&1; then
  for f in .debs/*.deb; do dpkg -x "$f" /tmp/debroot; done
  export LD_LIBRARY_PATH=/tmp/debroot/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
SURGE=(python3 -m surge.entrypoints.cli.main)  # run directly, not in a function: $! must be the process itself
# PRESET, DTYPE, SERVE_ARGS, N_SHORT, N_LONG, LONG_LEN: a smaller run (on the CPU: PRESET=tiny-llama DTYPE=float32
# SERVE_ARGS="--max-model-len 1024" N_SHORT=12 N_LONG=3 LONG_LEN=600).
PRESET=${PRESET:-qwen3-8b}; DTYPE=${DTYPE:-bfloat16}; MODEL_DIR=/tmp/surge-$PRESET-$DTYPE-serve
python3 tests/disagg/preset_server_dir.py "$PRESET" "$DTYPE" "$MODEL_DIR" || exit 1
read -ra SERVE <<< "${SERVE_ARGS:---max-model-len 10240 --max-num-seqs 128 --max-num-batched-tokens 8192}"
COMMON=("$MODEL_DIR" --dtype "$DTYPE" "${SERVE[@]}")
N_SHORT=${N_SHORT:-320}; N_LONG=${N_LONG:-16}; LONG_LEN=${LONG_LEN:-8000}
if [ "$GPUS" = 1 ]; then DEV=(0 0); MEM=(--kv-cache-memory $((40 << 30))); else DEV=(0 1); MEM=(); fi
KV='"kv_connector": "MooncakeTransferConnector", "kv_connector_extra_config": {"staging_gib": 16}'
if [ "$MODE" = disagg ]; then
  ROLE=(--kv-transfer-config "{$KV, \"kv_role\": \"kv_producer\"}" --kv-transfer-timeout 30)
  ROLE2=(--kv-transfer-config "{$KV, \"kv_role\": \"kv_consumer\"}")
else
  ROLE=(); ROLE2=()
fi
for port in 8100 8200 8000; do  # a server left from an earlier run would answer for the new one
  curl -s "http://127.0.0.1:$port/health" > /dev/null && { echo "port $port is taken"; exit 1; }
done
CUDA_VISIBLE_DEVICES=${DEV[0]} "${SURGE[@]}" serve "${COMMON[@]}" "${MEM[@]}" "${ROLE[@]}" --port 8100 \
  > "$OUT/$MODE-$GPUS-a.log" 2>&1 & a=$!
CUDA_VISIBLE_DEVICES=${DEV[1]} "${SURGE[@]}" serve "${COMMON[@]}" "${MEM[@]}" "${ROLE2[@]}" --port 8200 \
  > "$OUT/$MODE-$GPUS-b.log" 2>&1 & b=$!
if [ "$MODE" = disagg ]; then
  "${SURGE[@]}" proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000 > "$OUT/proxy.log" 2>&1 &
else
  "${SURGE[@]}" proxy --decode http://127.0.0.1:8100 http://127.0.0.1:8200 --port 8000 > "$OUT/proxy.log" 2>&1 &
fi
p=$!
trap 'kill $a $b $p 2>/dev/null; wait $a $b $p' EXIT
for _ in $(seq 300); do
  curl -sf http://127.0.0.1:8000/health > /dev/null && break
  kill -0 $a 2>/dev/null && kill -0 $b 2>/dev/null || { echo "an instance exited"; tail -n 20 "$OUT"/$MODE-$GPUS-*.log; exit 1; }
  sleep 1
done
curl -sf http://127.0.0.1:8000/health || { echo "not healthy in 300 s"; exit 1; }; echo
BENCH=(--base-url http://127.0.0.1:8000 --endpoint completions --vocab-size "${VOCAB:-150000}")
"${SURGE[@]}" bench serve "${BENCH[@]}" --num-prompts "$N_LONG" --input-len "$LONG_LEN" --output-len 16 --request-rate 0.4 \
  --goodput ttft:3000 --result-json "$OUT/$MODE-${GPUS}gpu-long.json" --chart "$OUT/$MODE-${GPUS}gpu-long.png" \
  > "$OUT/$MODE-${GPUS}gpu-long.txt" 2>&1 & long=$!
"${SURGE[@]}" bench serve "${BENCH[@]}" --num-prompts "$N_SHORT" --input-len 128 --output-len "${SHORT_OUT:-256}" --request-rate 8 \
  --goodput ttft:1000 tpot:30 --result-json "$OUT/$MODE-${GPUS}gpu-short.json" \
  --chart "$OUT/$MODE-${GPUS}gpu-short.png"
wait $long; echo "--- long prompts"; cat "$OUT/$MODE-${GPUS}gpu-long.txt"
echo "--- decode/prefill metrics"; curl -s http://127.0.0.1:8200/metrics | grep -E "^surge:(external_prefix|prompt_tokens|prefix_cache|kv_connector|num_preemptions|request_success)"
curl -s http://127.0.0.1:8100/metrics | grep -E "^surge:kv_connector_failures"
