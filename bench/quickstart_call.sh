#!/usr/bin/env bash
# Every stage's quickstart on several processes, as a user would run it (issue 23's "every stage's quickstart runs
# on 2 and 4 GPUs with DDP, and sft/dpo also with ZeRO-2, ZeRO-3 and FSDP2"), in one device call:
#
#   NPROC=2 bash bench/quickstart_call.sh                          # ddp for every stage; zero2/zero3/fsdp2 for sft, dpo
#   NPROC=4 STAGES="sft dpo" STRATEGIES="zero3 fsdp2" bash bench/quickstart_call.sh
#   NPROC=2 STAGES="sft grpo" SHARDED= STEPS=2 bash bench/quickstart_call.sh     # CPU smoke (gloo, ddp only)
#   NPROC=4 PARALLEL=3 bash bench/quickstart_call.sh                # three runs at a time: one device call
#
# Each run: `rlfactory train examples/quickstart/<stage>.yaml (ppo: examples/ppo/tiny_arith.yaml) distributed.num_processes=$NPROC train.max_steps=$STEPS`
# into its own output dir, stopped after $RUN_TIMEOUT s. A run passes when it exits 0, its output shows one start
# banner and one "saved ... model" line (one writer), and the output dir holds a model (config.json, or
# adapter_config.json for LoRA). One RESULT line per run (JSON) and a summary table; logs in $OUT/<run>.log.
# On a GPU host grpo/ppo use the vLLM kit (.gpu/vllm/setup.sh) when it is there, else the hf backend.
set -uo pipefail
cd "$(dirname "$0")/.."
NPROC=${NPROC:-2}
STAGES=${STAGES:-sft dpo kto orpo rm pt grpo ppo}
STRATEGIES=${STRATEGIES:-ddp}       # for every stage
SHARDED=${SHARDED-sft dpo}          # these stages also run under zero2, zero3 and fsdp2 (GPUs only)
STEPS=${STEPS:-20}
RUN_TIMEOUT=${RUN_TIMEOUT:-240}
PARALLEL=${PARALLEL:-1}             # runs at a time, e.g. 2 on a GPU host (each run still uses all $NPROC GPUs)
OUT=${OUT:-/tmp/quickstart}
mkdir -p "$OUT"
if command -v nvidia-smi > /dev/null; then  # the device kits (built for the GPU machine's Python) only there
  [ -f .gpu/vllm/setup.sh ] && { source .gpu/vllm/setup.sh > /dev/null 2>&1 || true; }
  for kit in .gpu/whl .gpu/whl-rl; do  # bench/gpu_kit.sh builds them
    [ -f $kit/setup.sh ] && { source $kit/setup.sh > /dev/null || true; break; }
  done
fi
export PYTHONPATH="$PWD/src:$PWD:/tmp/site:${PYTHONPATH:-}" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 DS_BUILD_OPS=0
PY=${PY:-python3}
GPU=$($PY -c "import torch; print(int(torch.cuda.is_available()))")
VLLM=$($PY -c "import importlib.util as u; print(int(u.find_spec('vllm') is not None))")

run() {  # run <stage> <strategy>
  local stage=$1 strategy=$2 name="$1-$2-x$NPROC" extra=()
  local dir="$OUT/$name" log="$OUT/$name.log"
  rm -rf "$dir"
  if [[ $stage == grpo || $stage == ppo ]]; then
    if [[ $GPU == 1 && $VLLM == 1 ]]; then
      extra=(rollout.backend=vllm rollout.gpu_memory_utilization=0.15)
    else
      extra=(rollout.backend=hf)
    fi
  fi
  [[ $stage == sft || $stage == dpo || $stage == kto || $stage == orpo || $stage == rm || $stage == pt ]] \
    && extra+=(evaluation.max_samples=32)
  local start=$SECONDS
  local yaml="examples/quickstart/$stage.yaml"
  [[ -f $yaml ]] || yaml="examples/$stage/tiny_arith.yaml"  # ppo has no quickstart file: its tiny-model example
  timeout "$RUN_TIMEOUT" $PY -m rlfactory train "$yaml" "output_dir=$dir" \
    "distributed.num_processes=$NPROC" "distributed.strategy=$strategy" "train.max_steps=$STEPS" "${extra[@]}" \
    > "$log" 2>&1
  local code=$? seconds=$((SECONDS - start))
  local banners saves model=0
  banners=$(grep -cE "^stage [a-z]+: " "$log")
  saves=$(grep -c "^saved .* model to \|INFO.*saved .* model to " "$log")
  { [ -f "$dir/config.json" ] || [ -f "$dir/adapter_config.json" ]; } && model=1
  local ok=false
  [[ $code == 0 && $banners == 1 && $saves == 1 && $model == 1 ]] && ok=true
  echo "RESULT {\"run\": \"$name\", \"ok\": $ok, \"exit\": $code, \"seconds\": $seconds, \"banners\": $banners, \"saved_lines\": $saves, \"model\": $model}"
  $ok || tail -n 15 "$log" | sed "s/^/  $name | /"
  echo "| $stage | $strategy | $NPROC | $code | $seconds | $banners | $saves | $model | $ok |" > "$OUT/$name.row"
}

# PARALLEL runs at a time (each on all $NPROC GPUs: the tiny model leaves them room; start-up is most of a run)
rm -f "$OUT"/*.row
for stage in $STAGES; do
  strategies=$STRATEGIES
  if [[ $GPU == 1 && " $SHARDED " == *" $stage "* ]]; then
    for strategy in zero2 zero3 fsdp2; do [[ " $STRATEGIES " == *" $strategy "* ]] || strategies+=" $strategy"; done
  fi
  for strategy in $strategies; do
    while [[ $(jobs -rp | wc -l) -ge $PARALLEL ]]; do wait -n; done
    run "$stage" "$strategy" &
  done
done
wait
echo "| stage | strategy | processes | exit | s | start banners | saved lines | model | ok |"
echo "|---|---|---|---|---|---|---|---|---|"
cat "$OUT"/*.row
