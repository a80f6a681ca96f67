#!/usr/bin/env bash
# GPU work that outlasts one device command (10 minutes): run it detached, then poll.
#   bash scripts/gpu_e2e_session.sh start      starts the chain below in a new session (setsid) and returns
#   bash scripts/gpu_e2e_session.sh wait SECS  polls up to SECS seconds, prints progress, copies results to $OUT
# Call `wait` again at once (a machine left idle is given back) until it prints "chain done".
# The chain, on an nvidia-h200-x4 (2 inference + 2 learner ranks; vLLM & co. on PYTHONPATH from the bundle):
#   1. e2e: configs/gpu-4.yaml (7B shape, Diplomacy, 32 groups x 2, horizon 4), async (the config's lag) then sync
#   2. trainer: 4 learner GPUs, the e2e workload's group size (2): padded baseline, packed, compiled
#   3. sync: adapter sync at the 7B shape on GPUs 0 and 1
# CHAIN_STEPS picks and orders the steps (comma list of e2e, trainer, sync; default e2e,trainer,sync);
# ONLY_E2E=1 means CHAIN_STEPS=e2e and CHAIN_SYNC=0 leaves out sync. TRAINER_COMPILE_BUDGET (default 16384)
# is the trainer's token budget of the compiled variant, TRAINER_ARGS more of its arguments; TRAINER_TRACE=NAME[,NAME] profiles one more step of
# those variants (summaries in its JSON). SYNC_ARGS: more sync-benchmark arguments; SYNC_TRACE=1 traces vLLM's engine core over five updates and their
# first tokens (summaries in the sync JSON). With metrics.profile=true in E2E_SET, the e2e traces go to
# $GS/prof and their summaries to e2e-traces.json. E2E_STEPS (default 6) sets the steps per job;
# E2E_SET adds settings to the e2e jobs (e.g. "engine.lora_mode=merged"); E2E_CONFIG, E2E_NPROC and
# E2E_ORDER (defaults configs/gpu-4.yaml, 4, async,sync) pick another preset (E2E_ORDER also takes
# async-stream, async-barrier, ..., and +NAME for a variant; E2E_STREAM_SET: settings of the -stream jobs only;
# E2E_VARIANTS: "NAME:k=v,k=v ..." for the +NAME jobs), e.g. the 8-GPU run:
#   ONLY_E2E=1 E2E_CONFIG=configs/gpu-8.yaml E2E_NPROC=8 E2E_STEPS=12 E2E_ORDER=async \
#     E2E_SET="topology.num_inference=6 topology.num_learners=2" bash scripts/gpu_e2e_session.sh start
# CHAIN_KERNEL=1 runs the loss-kernel sweep and Nsight Compute counters (CHAIN_KERNEL_NCU: one config;
# default: the default launch and '{"num_warps": 16}') on GPU 0 before step 1 (~4 min; liger-kernel on PYTHONPATH
# for its column).
# CHAIN_TESTS=EXPR runs the GPU tests beside that step: tests/test_kernel_triton.py on GPU 1 (not with
# CHAIN_TESTS_KERNEL=0), tests/test_vllm_gpu.py -k EXPR on GPUs 2-3 (logs tests-*.log); the e2e and
# trainer steps wait for both, the sync step (GPUs 0-1) does not (so it wants CHAIN_TESTS_KERNEL=0).
# Results: /tmp/gs/*.json and logs; `wait` copies them to $OUT.
set -u
GS=/tmp/gs
mode=${1:?usage: gpu_e2e_session.sh start|wait SECS}
export PYTHONUNBUFFERED=1 NCCL_CUMEM_ENABLE=0 TOKENIZERS_PARALLELISM=false VLLM_USE_FLASHINFER_SAMPLER=0
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True

chain() {
  cd "$1" || exit 1
  E2E_STEPS=${E2E_STEPS:-6}
  tests_pid=
  if [ -n "${CHAIN_TESTS:-}" ]; then  # GPU tests on GPUs 1-3 beside the kernel step; e2e waits for them
    [ "${CHAIN_TESTS_KERNEL:-1}" = 1 ] && \
    ( CUDA_VISIBLE_DEVICES=1 timeout -k 20 420 python3 -m pytest -q -m gpu tests/test_kernel_triton.py \
        > $GS/tests-kernel.log 2>&1
      echo "tests-kernel rc=$?" >> $GS/tests-kernel.log ) &
    ( CUDA_VISIBLE_DEVICES=2,3 timeout -k 20 600 python3 -m pytest -q -m gpu tests/test_vllm_gpu.py -k "$CHAIN_TESTS" \
        > $GS/tests-vllm.log 2>&1
      echo "tests-vllm rc=$?" >> $GS/tests-vllm.log ) &
    tests_pid="$(jobs -p)"
  fi
  if [ -n "${CHAIN_KERNEL:-}" ]; then  # the loss kernel first, on GPU 0: sweep, then counters of a config
    echo "== $(date +%T) kernel"
    CUDA_VISIBLE_DEVICES=0 timeout -k 20 400 python3 scripts/benchmark.py --profile kernel --sweep --no-compile \
      --iters 20 --out $GS/kernel.json > $GS/kernel.log 2>&1
    if [ -n "${CHAIN_KERNEL_NCU:-}" ]; then ncu_cfgs=("$CHAIN_KERNEL_NCU"); else ncu_cfgs=('{}' '{"num_warps": 16}'); fi
    CUDA_VISIBLE_DEVICES=0 timeout -k 20 300 bash scripts/kernel_ncu.sh $GS/ncu "${ncu_cfgs[@]}" \
      > $GS/ncu.log 2>&1 && cp $GS/ncu/details.csv $GS/ncu-details.csv
    echo "== $(date +%T) kernel rc=$?"
  fi
  steps=${CHAIN_STEPS:-e2e,trainer,sync}
  [ -n "${ONLY_E2E:-}" ] && steps=e2e
  [ "${CHAIN_SYNC:-1}" = 0 ] && steps=${steps//sync/}
  for step in ${steps//,/ }; do
    case $step in e2e|trainer|sync) ;; *) echo "== unknown chain step '$step' (e2e, trainer, sync)"; continue ;; esac
    [ "$step" != sync ] && wait_tests  # sync takes GPUs 0-1 only: it runs beside the tests
    "step_$step"
  done
  wait_tests
  echo "chain done"
}

wait_tests() {
  [ -n "$tests_pid" ] && { wait $tests_pid; echo "== $(date +%T) tests: $(tail -qn1 $GS/tests-*.log | tr '\n' ' ')"; }
  tests_pid=
}

step_e2e() {
  echo "== $(date +%T) e2e"
  timeout -k 20 1500 python3 scripts/benchmark.py --profile e2e --config "${E2E_CONFIG:-configs/gpu-4.yaml}" \
    --nproc "${E2E_NPROC:-4}" --steps "$E2E_STEPS" --warmup 2 --order "${E2E_ORDER:-async,sync}" --job-timeout-s 720 \
    --partial $GS/e2e-partial.json --out $GS/e2e-h200x"${E2E_NPROC:-4}".json --set metrics.nvml_interval_s=1 checkpoint.enabled=false metrics.stall_timeout_s=0 \
    metrics.profile_dir=$GS/prof ${E2E_SET:-} ${E2E_STREAM_SET:+--stream-set $E2E_STREAM_SET} ${E2E_VARIANTS:+--variant $E2E_VARIANTS}
  echo "== $(date +%T) e2e rc=$?"
  for f in /tmp/colocate-e2e-*/*.log; do cp "$f" "$GS/$(basename "$f" .log)-job.log"; done
  traces=$(find $GS/prof -name "*.json*" 2>/dev/null | sort)
  [ -n "$traces" ] && python3 scripts/trace_summary.py $traces > $GS/e2e-traces.json
}

step_trainer() {
  echo "== $(date +%T) trainer"
  timeout -k 20 420 python3 scripts/benchmark.py --profile trainer --num-gpus 4 --group-size 2 --budgets 16384 \
    --sdpa-budget 0 --ac-budget 0 --compile-budget "${TRAINER_COMPILE_BUDGET:-16384}" --time-limit-s 300 --partial $GS/trainer-partial.json \
    ${TRAINER_TRACE:+--trace-variant $TRAINER_TRACE --trace-dir $GS/trainer-trace} ${TRAINER_ARGS:-} --out $GS/trainer-h200x4-g2.json
  echo "== $(date +%T) trainer rc=$?"
}

step_sync() {
  echo "== $(date +%T) sync 7b"
  CUDA_VISIBLE_DEVICES=0,1 COLOCATE_PARTIAL_JSON=$GS/sync-7b-partial.json timeout -k 20 300 \
    python3 scripts/benchmark.py --profile sync --shape 7b --budget-s 200 \
    $([ "${SYNC_TRACE:-0}" = 1 ] && echo --trace-dir $GS/sync-trace) ${SYNC_ARGS:-} --out $GS/sync-7b.json
  echo "== $(date +%T) sync rc=$?"
}

case $mode in
  start)
    rm -rf $GS; mkdir -p $GS
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    repo=$(pwd)
    export -f chain wait_tests step_e2e step_trainer step_sync
    export GS
    setsid nohup bash -c "chain $repo" > $GS/chain.log 2>&1 < /dev/null &
    echo "started chain (pid $!), log $GS/chain.log"
    ;;
  wait)
    secs=${2:-540}
    t0=$(date +%s)
    while [ $(( $(date +%s) - t0 )) -lt "$secs" ] && ! grep -q "chain done" $GS/chain.log 2>/dev/null; do
      sleep 10
    done
    echo "---- chain.log"; tail -n 40 $GS/chain.log
    for f in /tmp/colocate-e2e-*/*.log; do [ -f "$f" ] && { echo "---- $f"; grep -E "step [0-9]+/|summary|Error|error|Traceback" "$f" | tail -n 12; }; done
    nvidia-smi --query-gpu=index,utilization.gpu,memory.used --format=csv,noheader
    [ -n "${OUT:-}" ] && cp $GS/*.json $GS/*.log $GS/*.csv "$OUT"/ 2>/dev/null
    grep -q "chain done" $GS/chain.log && echo "chain done" || echo "chain running"
    ;;
esac
