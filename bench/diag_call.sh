#!/usr/bin/env bash
# Where a second process's time goes in a dpo LoRA step (issue 23): one traced step per process
# (bench/step_trace.py) of dpo LoRA and sft LoRA on 1 and 2 GPUs, and dpo with DDP's own switches, on a 4-GPU
# host in one device call. Summaries on stdout (TRACE lines), dpo traces packed into $OUT/traces.tar.
set -uo pipefail
cd "$(dirname "$0")/.."
source .gpu/vllm/setup.sh > /dev/null
source .gpu/whl/setup.sh > /dev/null 2>&1 || source .gpu/whl-rl/setup.sh > /dev/null  # bench/gpu_kit.sh
export PYTHONPATH="$PWD/src:$PWD:/tmp/site:${PYTHONPATH:-}" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 DS_BUILD_OPS=0
export OMP_NUM_THREADS=$(($(nproc) / 4)) TRACE_DIR=/tmp/traces
OUT=${OUT:-/tmp/diag}
mkdir -p "$OUT" "$TRACE_DIR"
nvidia-smi topo -m; nproc
bench() {  # bench <visible GPUs> <log> <args...>
  local gpus=$1 log=$2
  shift 2
  CUDA_VISIBLE_DEVICES=$gpus python3 bench/train_bench.py --accum 4 --steps 4 --warmup 2 --trace-step 4 "$@" \
    > "$OUT/$log.txt" 2>&1
}
t=$(date +%s)
bench 0 dpo1 --cases dpo_lora --impls ours_compile --gpus 1 &
bench 1 sft1 --cases sft_lora --impls ours_compile --gpus 1 &
bench 2,3 dpo2 --cases dpo_lora --impls ours_compile --gpus 2 &
wait
echo "phase A: $(($(date +%s) - t)) s"
bench 0,1 sft2 --cases sft_lora --impls ours_compile --gpus 2 &
bench 2,3 dpo2lev --cases dpo_lora --impls ours_compile-static-bigbucket-bucketview --gpus 2 &
wait
echo "phase B: $(($(date +%s) - t)) s"
for f in "$OUT"/*.txt; do echo "== $f"; grep -v '^dpo_lora/.*cpu|\|^sft_lora/.*cpu|' "$f" | grep 'TRACE\|^{' ; done
for f in "$OUT"/*.txt; do echo "== $f"; grep 'cpu|' "$f" | head -24; done > "$OUT/cpu_tables.log"
ls -la "$TRACE_DIR"
tar -cf "$OUT/traces.tar" -C "$TRACE_DIR" $(cd "$TRACE_DIR" && ls trace_dpo_lora_ours_compile_[12]gpu_r* 2> /dev/null)
ls -la "$OUT"
