#!/usr/bin/env bash
# rollout.update drain against inflight on one GPU (an 80 GB H100), both roles on it, detached:
#   bash scripts/gpu_inflight_session.sh start      starts the chain in a new session and returns
#   bash scripts/gpu_inflight_session.sh wait SECS  polls up to SECS seconds, copies results to $OUT
# Call `wait` again at once until it prints "chain done"; it prints the table once the e2e jobs are in.
# vLLM & co. on PYTHONPATH (the GPU bundle, DEVELOPERS.md). The chain (INFLIGHT_STEPS picks and
# orders them; default e2e1,e2egsm,e2e7b,learn):
#   e2e1     configs/gpu-1.yaml, 10 steps with --rollout.update=drain, then 10 with inflight (e2e benchmark:
#            steady state past --warmup 3; s/step, learner busy, NVML utilization)
#   e2egsm   configs/gpu-1-gsm8k.yaml the same (eval off; GSM8K_MODEL=/path sets model.path, else the
#            0.5B shape with random weights: every completion runs to 256 tokens)
#   e2e7b    configs/gpu-1-7b.yaml the same
#   learn    the GPU learning test: cpu-tiny on vLLM reaches 0.9 with drain and with inflight
#            (tests/test_vllm_gpu.py::test_cpu_tiny_learns_with_vllm_on_one_gpu)
# Each job's GPU memory per process is sampled by nvidia-smi every 2 s (mem-*.csv).
set -u
GS=/tmp/gsi
mode=${1:?usage: gpu_inflight_session.sh start|wait SECS}
export PYTHONUNBUFFERED=1 NCCL_CUMEM_ENABLE=0 TOKENIZERS_PARALLELISM=false VLLM_USE_FLASHINFER_SAMPLER=0
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True

with_memory() {  # with_memory NAME CMD... : run CMD, sampling per-process GPU memory into mem-NAME.csv
  local name=$1
  shift
  nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader -l 2 > "$GS/mem-$name.csv" &
  local smi=$!
  "$@" > "$GS/$name.log" 2>&1
  local rc=$?
  kill $smi 2>/dev/null
  echo "== $(date +%T) $name rc=$rc" >> "$GS/chain.log"
}

both_modes() {  # both_modes NAME CONFIG [OVERRIDES...]: 10 steps drain, then 10 steps inflight, one record
  local name=$1 config=$2
  shift 2
  with_memory "$name" timeout 3000 python3 scripts/benchmark.py --profile e2e --config "$config" --nproc 2 \
    --steps 10 --warmup 3 --order async+drain,async+inflight --variant drain:rollout.update=drain \
    inflight:rollout.update=inflight --set "$@" --out "$GS/$name.json"
}

chain() {
  cd "$1" || exit 1
  local gsm_model=()
  [ -n "${GSM8K_MODEL:-}" ] && gsm_model=("model.path=$GSM8K_MODEL")
  for s in $(echo "${INFLIGHT_STEPS:-e2e1,e2egsm,e2e7b,learn}" | tr , ' '); do
    echo "== $(date +%T) $s start" >> "$GS/chain.log"
    case $s in
      e2e1) both_modes e2e1 configs/gpu-1.yaml checkpoint.enabled=false ;;
      e2egsm) both_modes e2egsm configs/gpu-1-gsm8k.yaml checkpoint.enabled=false eval.every=0 eval.at_end=false \
              "${gsm_model[@]}" ;;
      e2e7b) both_modes e2e7b configs/gpu-1-7b.yaml checkpoint.enabled=false ;;
      learn) with_memory learn timeout 2000 python3 -m pytest -q -m gpu -p no:cacheprovider \
              "tests/test_vllm_gpu.py::test_cpu_tiny_learns_with_vllm_on_one_gpu" ;;
    esac
  done
  echo "chain done" >> "$GS/chain.log"
}
export -f chain with_memory both_modes
export GS

table() {  # the e2e records so far: one row per config and mode
  python3 - "$GS" <<'PY'
import glob, json, os, sys
print(f"{'config':<22} {'update':<9} {'s/step':>7} {'learner busy':>13} {'GPU util':>9} {'dropped':>8}")
for path in sorted(glob.glob(os.path.join(sys.argv[1], "e2e*.json"))):
    record = json.load(open(path))
    for job, r in record["runs"].items():
        util = r.get("inference_nvml_busy") or r.get("learner_nvml_busy")
        print(f"{os.path.basename(record['config']):<22} {job.split('+')[-1]:<9} {r['seconds_per_step']:>7.2f} "
              f"{100 * r['learner_busy_fraction']:>12.0f}% {'' if util is None else f'{100 * util:.0f}%':>9} "
              f"{r['dropped_stale']:>8.0f}")
PY
}

case $mode in
  start)
    rm -rf "$GS"; mkdir -p "$GS"
    repo=/tmp/inflight-repo; rm -rf $repo; cp -r . $repo
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$GS/gpu.txt"
    setsid nohup bash -c "chain $repo" > "$GS/chain.out" 2>&1 < /dev/null &
    echo "started"; cat "$GS/gpu.txt" ;;
  wait)
    end=$(( $(date +%s) + ${2:-500} ))
    while [ "$(date +%s)" -lt "$end" ] && ! grep -q "chain done" "$GS/chain.log" 2>/dev/null; do sleep 10; done
    cat "$GS/chain.log"
    for f in "$GS"/*.log; do echo "---- $f"; grep -E "\[e2e\]|summary|colocate:|Error|error|passed|failed" "$f" | tail -n 8 | cut -c1-400; done
    table | tee "$GS/table.txt"
    mkdir -p "$OUT"
    tar czf "$OUT/inflight.tgz" -C "$GS" . 2>/dev/null
    ls -la "$OUT" ;;
esac
