#!/usr/bin/env bash
# The 1-, 2- and 4-GPU scaling table (docs/BENCHMARKS.md, "Several GPUs"), ours beside TRL at its fastest
# switches, in one device call on a 4-GPU host (nvidia-h100-x4 / nvidia-h200-x4) or a 2-GPU one:
#
#   bash bench/scaling_call.sh sft_full dpo_lora                       # offline cases, Qwen2.5-0.5B shape
#   SHAPE=qwen2.5-7b BATCH=2 bash bench/scaling_call.sh sft_lora dpo_lora
#   bash bench/scaling_call.sh grpo                                     # grpo LoRA, colocated vLLM, ours and TRL
#   SHAPE=tiny BATCH=2 SEQ=64 STEPS=2 WARMUP=1 bash bench/scaling_call.sh sft_lora   # CPU smoke (gloo)
#   LEVERS=ours_compile-masksel bash bench/scaling_call.sh dpo_lora           # also the code before a change
#   STEPS=8 COUNTS=4 RUN_TIMEOUT=330 bash bench/scaling_call.sh sft_full       # ours and TRL on 4 GPUs only
#   SHAPE=qwen2.5-7b COUNTS=2 GRPO_CASES=grpo GRPO_RUNS=adapter:8:compile CASE_TIMEOUT=400 LANE_TIMEOUT=420 \
#     TORCH_LOGS=recompiles bash bench/scaling_call.sh grpo                   # 7B grpo, every recompile in the log
#
# Each run alone on the host, one after the other (1, 2, then 4 GPUs; ours, TRL, then the levers): a step that
# waits on its host also waits on a neighbour's use of it, and side-by-side runs gave a dpo LoRA step 13% more
# time on 2 GPUs (docs/BENCHMARKS.md, fourteenth session). LANES=1 keeps the faster layout of earlier sessions
# for a smoke run: on a 4-GPU host the 1- and 2-GPU runs side by side on disjoint GPUs (ours on GPU 0, TRL on
# GPU 1, both on GPUs 2,3), then the 4-GPU runs. Every process gets the CPU threads a 4-process launch gives
# it (cores / 4), so a 1-GPU run is not favoured by more threads.
# Needs in the checkout: .gpu/whl or .gpu/whl-rl (`bash bench/gpu_kit.sh`: trl, datasets, liger-kernel, ...) and, for grpo,
# .gpu/vllm/setup.sh (a vLLM build for the device's torch). Writes $OUT/scaling_<case>.jsonl and one log per lane.
set -uo pipefail
cd "$(dirname "$0")/.."
[ $# -gt 0 ] || { sed -n 2,21p "$0"; exit 2; }
OUT=${OUT:-/tmp/scaling}
SHAPE=${SHAPE:-qwen2.5-0.5b}
BATCH=${BATCH:-8}
SEQ=${SEQ:-1024}
STEPS=${STEPS:-4}
WARMUP=${WARMUP:-2}
GRPO_CASES=${GRPO_CASES:-grpo,trl}  # grpo: ours and TRL's GRPOTrainer, one after the other in each lane
CASE_TIMEOUT=${CASE_TIMEOUT:-260}   # grpo: seconds per case (vLLM's start-up included), and per lane below
LANE_TIMEOUT=${LANE_TIMEOUT:-560}
GRPO_RUNS=${GRPO_RUNS:-adapter:64:compile}  # grpo: lora_sync:micro-batch[:compile] (adapter:8:compile for the 7B)
IMPLS=${IMPLS:-}    # offline cases: the impls to run (default ours_compile and TRL's fastest); e.g. IMPLS=ours_compile
RUN_TIMEOUT=${RUN_TIMEOUT:-0}  # offline cases: seconds per run before it is stopped (0: none), e.g. 300 for TRL on 4 GPUs
LEVERS=${LEVERS:-}  # offline cases: more impls of ours (e.g. ours_compile-masksel) on 1 GPU (beside TRL's lane) and 4
mkdir -p "$OUT" /tmp/site
if [ -f .gpu/vllm/setup.sh ]; then
  # shellcheck disable=SC1091
  source .gpu/vllm/setup.sh > /dev/null
fi
if [ -f .gpu/whl/setup.sh ]; then  # the packages as one archive (unpacked into /tmp/site)
  # shellcheck disable=SC1091
  source .gpu/whl/setup.sh > /dev/null
elif [ -f .gpu/whl-rl/setup.sh ]; then  # the same without DeepSpeed and pydantic, beside the vLLM kit
  # shellcheck disable=SC1091
  source .gpu/whl-rl/setup.sh > /dev/null
elif compgen -G ".gpu/whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/whl/*.whl || exit 2
fi
export PYTHONPATH="$PWD/src:$PWD:/tmp/site:${PYTHONPATH:-}" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 DS_BUILD_OPS=0
OMP_NUM_THREADS=$(($(nproc) / 4 > 0 ? $(nproc) / 4 : 1))
export OMP_NUM_THREADS
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader 2> /dev/null || echo "no GPU: a CPU smoke run"

# TRL's fastest switches found per case (docs/BENCHMARKS.md): packing wrapped + torch_compile for sft, Liger +
# torch_compile for dpo
trl_impl() {
  [ -z "${TRL_IMPL:-}" ] || { echo "$TRL_IMPL"; return; }  # e.g. TRL_IMPL=trl_compile where the fastest fails
  case $1 in
    sft_*) echo trl_wrapped_compile ;;
    dpo_*) echo trl_liger_compile ;;
    *) echo trl ;;
  esac
}

stamp() { echo "$(date +%T) $*" >> "$OUT/timing.log"; }  # when each run starts and ends (start-up is most of a run)

offline() {  # offline <case> <impl> <gpus> <visible GPUs>
  stamp "start $1 $2 ${3//,/-}gpu"
  CUDA_VISIBLE_DEVICES=$4 python3 bench/train_bench.py --cases "$1" --impls "$2" --gpus "$3" --shape "$SHAPE" \
    --batch "$BATCH" --seq "$SEQ" --accum 4 --steps "$STEPS" --warmup "$WARMUP" --run-timeout "$RUN_TIMEOUT" 2>> "$OUT/$1_$2_${3//,/-}gpu.err" \
    | grep '^{' >> "$OUT/scaling_$1.jsonl"
  stamp "end $1 $2 ${3//,/-}gpu"
}

grpo() {  # grpo <gpus> <visible GPUs>
  stamp "start grpo ${1}gpu"
  (cd bench && CUDA_VISIBLE_DEVICES=$2 timeout "$LANE_TIMEOUT" python3 rollout_bench.py --cases "$GRPO_CASES" --gpus "$1" \
    --shape "$SHAPE" --steps "${GRPO_STEPS:-6}" --warmup 2 --grpo-runs "$GRPO_RUNS" --case-timeout "$CASE_TIMEOUT" \
    --out "$OUT/scaling_grpo.jsonl" --log "$OUT/grpo_$1gpu.log" > /dev/null 2>&1)
  stamp "end grpo ${1}gpu"
}

# the host's GPU count (4 on a CPU smoke run) and the counts each case runs on: 1, 2, 4 up to it
NGPU=${NGPU:-$(nvidia-smi -L 2> /dev/null | grep -c '^GPU' || true)}
[ "${NGPU:-0}" -gt 0 ] || NGPU=4
ALL=$(seq -s, 0 $((NGPU - 1)))
if [ -z "${COUNTS:-}" ]; then  # COUNTS=4: only the 4-GPU runs (each-alone layout)
  COUNTS=$(for n in 1 2 4 8; do [ "$n" -gt "$NGPU" ] || printf '%s,' "$n"; done)
  COUNTS=${COUNTS%,}
fi
for case in "$@"; do
  start=$(date +%s)
  if [ "$case" = grpo ] && [ "${LANES:-0}" = 1 ] && [ "$NGPU" -ge 4 ]; then
    grpo 1 0 & grpo 2 2,3 & wait
    grpo 4 "$ALL"
  elif [ "$case" = grpo ]; then
    for n in ${COUNTS//,/ }; do grpo "$n" "$(seq -s, 0 $((n - 1)))"; done
  elif [ "${LANES:-0}" = 1 ]; then
    trl=$(trl_impl "$case")
    (offline "$case" ours_compile 1 0; [ "$NGPU" -ge 4 ] || for lever in $LEVERS; do offline "$case" "$lever" 1 0; done) &
    [ "$IMPLS" = ours_compile ] ||
      (offline "$case" "$trl" 1 1; [ "$NGPU" -lt 4 ] || for lever in $LEVERS; do offline "$case" "$lever" 1 1; done) &
    [ "$NGPU" -lt 4 ] || (offline "$case" ours_compile 2 2,3; [ "$IMPLS" = ours_compile ] || offline "$case" "$trl" 2 2,3) &
    wait
    offline "$case" ours_compile "$NGPU" "$ALL"
    [ "$IMPLS" = ours_compile ] || offline "$case" "$trl" "$NGPU" "$ALL"
    for lever in $LEVERS; do offline "$case" "$lever" "$NGPU" "$ALL"; done
  else  # each run alone: train_bench runs the counts in turn on the first n GPUs
    for impl in ${IMPLS:-ours_compile $(trl_impl "$case")} $LEVERS; do offline "$case" "$impl" "$COUNTS" "$ALL"; done
  fi
  echo "$case: $(($(date +%s) - start)) s"
  cat "$OUT/scaling_$case.jsonl" 2>/dev/null
done
