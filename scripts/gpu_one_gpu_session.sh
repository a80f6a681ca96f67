#!/usr/bin/env bash
# Both roles on one GPU (an 80 GB H100), detached so it can outlast one device command:
#   bash scripts/gpu_one_gpu_session.sh start      starts the chain in a new session and returns
#   bash scripts/gpu_one_gpu_session.sh wait SECS  polls up to SECS seconds, copies results to $OUT
# Call `wait` again at once until it prints "chain done". vLLM & co. on PYTHONPATH (the GPU bundle).
# The chain (ONE_STEPS picks and orders them; default test,gpu1,sync,gpu1-7b):
#   test     tests/test_shared_gpu.py on the GPU (HF engine, 3 steps, adapter by CUDA IPC, checksums)
#   gpu1     configs/gpu-1.yaml, 10 steps (0.5B shape, vLLM)
#   sync     the sync benchmark at the 7B shape with the engine on the learner's GPU (IPC) and the disk path
#   gpu1-7b  configs/gpu-1-7b.yaml, 5 steps (7B shape); gpu1-7b-tree: the same with learner.prefix_sharing=tree
#   gputests the one-GPU tests marked gpu: kernels, objectives, prefix trees, varlen packing, shared GPU
#   kernel   the loss-kernel benchmark (GRPO and the other objectives at 16,384 x 152,064)
#   tree     the trainer benchmark on the e2e workload's shapes: flat against tree and group packing
# Each job's GPU memory per process is sampled by nvidia-smi every 2 s (mem-*.csv: the peak per role).
set -u
GS=/tmp/gs1
mode=${1:?usage: gpu_one_gpu_session.sh start|wait SECS}
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

chain() {
  cd "$1" || exit 1
  for s in $(echo "${ONE_STEPS:-test,gpu1,sync,gpu1-7b}" | tr , ' '); do
    echo "== $(date +%T) $s start" >> "$GS/chain.log"
    case $s in
      test) with_memory test timeout 600 python3 -m pytest -q -m gpu tests/test_shared_gpu.py -p no:cacheprovider ;;
      gpu1) with_memory gpu1 timeout 900 torchrun --nproc-per-node 2 -m colocate.train --config configs/gpu-1.yaml \
              --learner.num_steps=10 --metrics.run_dir=$GS/run-gpu1 ;;
      sync) with_memory sync timeout 700 python3 scripts/benchmark.py --profile sync --one-gpu --shape 7b \
              --budget-s 420 --out "$GS/sync-7b-1gpu.json" ;;
      gpu1-7b) with_memory gpu1-7b timeout 1200 torchrun --nproc-per-node 2 -m colocate.train \
              --config configs/gpu-1-7b.yaml --learner.num_steps=5 --metrics.run_dir=$GS/run-gpu1-7b ;;
      gpu1-7b-tree) with_memory gpu1-7b-tree timeout 1200 torchrun --nproc-per-node 2 -m colocate.train \
              --config configs/gpu-1-7b.yaml --learner.num_steps=5 --learner.prefix_sharing=tree \
              --metrics.run_dir=$GS/run-gpu1-7b-tree ;;
      prefixtest) with_memory prefixtest timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider \
              tests/test_prefix_sharing.py ;;
      gputests) with_memory gputests timeout 900 python3 -m pytest -q -m gpu -p no:cacheprovider \
              tests/test_kernel_bulk.py tests/test_kernel_triton.py tests/test_prefix_sharing.py \
              tests/test_packing.py tests/test_shared_gpu.py tests/test_loss_reference.py ;;
      kernel) with_memory kernel timeout 600 python3 scripts/benchmark.py --profile kernel --iters 20 --no-compile \
              --out "$GS/kernel.json" ;;
      tree) with_memory tree timeout 600 python3 scripts/benchmark.py --profile trainer --num-gpus 1 \
              --seqs-per-rank 448 --group-size 2 --budgets 16384 --prefix-sharing tree,group --padded-batch 0 \
              --sdpa-budget 0 --ac-budget 0 --time-limit-s 480 --out "$GS/trainer-tree.json" ;;
    esac
  done
  echo "chain done" >> "$GS/chain.log"
}
export -f chain with_memory
export GS

case $mode in
  start)
    rm -rf "$GS"; mkdir -p "$GS"
    repo=/tmp/one-gpu-repo; rm -rf $repo; cp -r . $repo
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$GS/gpu.txt"
    setsid nohup bash -c "chain $repo" > "$GS/chain.out" 2>&1 < /dev/null &
    echo "started"; cat "$GS/gpu.txt" ;;
  wait)
    end=$(( $(date +%s) + ${2:-500} ))
    while [ "$(date +%s)" -lt "$end" ] && ! grep -q "chain done" "$GS/chain.log" 2>/dev/null; do sleep 10; done
    cat "$GS/chain.log"
    for f in "$GS"/*.log; do echo "---- $f"; grep -E "step [0-9]+/|summary|colocate:|Error|error|passed|failed" "$f" | tail -n 12; done
    mkdir -p "$OUT"
    tar czf "$OUT/one-gpu.tgz" -C "$GS" --exclude='run-*/checkpoints' --exclude='*.tfevents*' . 2>/dev/null
    ls -la "$OUT" ;;
esac
