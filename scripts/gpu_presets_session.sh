#!/usr/bin/env bash
# The multi-GPU presets as shipped, with the README's command, on the machine at hand (issue 51).
#   bash scripts/gpu_presets_session.sh start   starts the chain below detached (setsid); run it from a
#                                               copy of the tree (cp -r . /tmp/w): each device call replaces the tree
#   bash scripts/gpu_presets_session.sh wait SECS  polls, prints the table so far, copies results to $OUT
# Call `wait` again at once until it prints "chain done" (a machine idle 30 s is given back).
# PRESET_JOBS: space-separated NAME:CONFIG:NPROC[:STEPS[:extra=args,...]] (default: gpu-2 cold, then warm),
# each on GPUs 0..NPROC-1;
# PRESET_TESTS=EXPR runs `pytest -m gpu -rA -k EXPR` after the jobs (PRESET_TESTS_GPUS picks the GPUs).
# Each job: `colocate train --config CONFIG --nproc-per-node N --learner.num_steps=STEPS`, its own run dir;
# the table (scripts/preset_table.py) gives launch -> end of step 1, median s/step over steps 3.., both
# roles' busy %, and per rank the plan's estimate against the measured peaks.
set -u
GS=/tmp/gp
mode=${1:?usage: gpu_presets_session.sh start|wait SECS}
export PYTHONUNBUFFERED=1 NCCL_CUMEM_ENABLE=0 TOKENIZERS_PARALLELISM=false VLLM_USE_FLASHINFER_SAMPLER=0
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True

chain() {
  cd "$1" || exit 1
  ngpu=$(nvidia-smi -L | wc -l)
  for job in ${PRESET_JOBS:-gpu-2-cold:configs/gpu-2.yaml:2:10 gpu-2-warm:configs/gpu-2.yaml:2:3}; do
    IFS=: read -r name config nproc steps extra <<< "$job"
    args=()
    if [ -n "${extra:-}" ]; then IFS=, read -r -a args <<< "$extra"; args=("${args[@]/#/--}"); fi
    echo "== $(date +%T) $name: colocate train --config $config --nproc-per-node $nproc --learner.num_steps=${steps:-10} ${args[*]}"
    pkill -f VLLM::EngineCore 2>/dev/null
    date +%s.%N > $GS/$name.launch
    gpus=$(seq -s, 0 $(( nproc < ngpu ? nproc - 1 : ngpu - 1 )))  # a 2-GPU preset on GPUs 0-1 of a larger box
    CUDA_VISIBLE_DEVICES=$gpus timeout -k 30 900 python3 -m colocate.cli train --config "$config" --nproc-per-node "$nproc" \
      --learner.num_steps="${steps:-10}" --metrics.run_dir=$GS/runs/$name --overwrite "${args[@]}" \
      > $GS/$name.log 2>&1
    echo "== $(date +%T) $name rc=$?"
    cp $GS/runs/$name/summary.json $GS/$name-summary.json 2>/dev/null
    cp $GS/runs/$name/memory_plan.json $GS/$name-plan.json 2>/dev/null
  done
  if [ -n "${PRESET_TESTS:-}" ]; then
    echo "== $(date +%T) gpu tests -k ${PRESET_TESTS}"
    CUDA_VISIBLE_DEVICES=${PRESET_TESTS_GPUS:-0,1} timeout -k 20 ${PRESET_TESTS_S:-900} python3 -m pytest -q -m gpu -rA \
      -p no:cacheprovider -k "$PRESET_TESTS" tests > $GS/gpu-tests.log 2>&1
    echo "== $(date +%T) gpu tests rc=$?"
  fi
  echo "chain done"
}

case $mode in
  start)
    rm -rf $GS; mkdir -p $GS
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    export -f chain
    export GS
    setsid nohup bash -c "chain $(pwd)" > $GS/chain.log 2>&1 < /dev/null &
    echo "started chain (pid $!), log $GS/chain.log"
    ;;
  wait)
    secs=${2:-540}
    t0=$(date +%s)
    while [ $(( $(date +%s) - t0 )) -lt "$secs" ] && ! grep -q "chain done" $GS/chain.log 2>/dev/null; do
      sleep 5
    done
    echo "---- chain.log"; tail -n 12 $GS/chain.log
    for f in $GS/*.log; do
      [ "$(basename $f)" = chain.log ] && continue
      echo "---- $f"; grep -E "step [0-9]+/|summary:|memory plan|auto ->|Error|error:|failed|Traceback|OutOfMemory" "$f" | tail -n 8
    done
    nvidia-smi --query-gpu=index,utilization.gpu,memory.used --format=csv,noheader
    python3 scripts/preset_table.py $GS 2>&1 | tee $GS/table.md
    if [ -n "${OUT:-}" ]; then
      tar -czf "$OUT/presets.tgz" -C $GS --exclude=runs . 2>/dev/null
      cp $GS/table.md "$OUT"/ 2>/dev/null
    fi
    grep -q "chain done" $GS/chain.log && echo "chain done" || echo "chain running"
    ;;
esac
