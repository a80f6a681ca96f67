#!/usr/bin/env bash
# Both roles on one GPU (an 80 GB H100), detached so it can outlast one device command:
#   bash scripts/gpu_one_gpu_session.sh start      starts the chain in a new session and returns
#   bash scripts/gpu_one_gpu_session.sh wait SECS  polls up to SECS seconds, copies results to $OUT
# Call `wait` again at once until it prints "chain done"; it prints the e2e table once e2e jobs are in.
# vLLM & co. on PYTHONPATH (the GPU bundle, DEVELOPERS.md). The chain (ONE_STEPS picks and orders
# them; default test,gpu1,sync,gpu1-7b):
#   test     tests/test_shared_gpu.py on the GPU (HF engine, 3 steps, adapter by CUDA IPC, checksums)
#   gpu1     configs/gpu-1.yaml, 10 steps (0.5B shape, vLLM)
#   sync     the sync benchmark at the 7B shape with the engine on the learner's GPU (IPC) and the disk path
#   syncfp8m the same in merged mode, bf16 then FP8 (the adapter requantized into the e4m3 weights at each
#            update): what an update costs the engine in each (sync-7b-merged-none.json, sync-7b-merged-fp8.json)
#   gpu1-7b  configs/gpu-1-7b.yaml, 5 steps (7B shape); gpu1-7b-tree: the same with learner.prefix_sharing=tree
#   gputests the one-GPU tests marked gpu: kernels, objectives, prefix trees, varlen packing, shared GPU
#   suite    the whole GPU suite as a user runs it (`python3 -m pytest -q -m gpu tests`): suite.log, suite.xml,
#            its counts and slowest tests in the chain log; suite2 the same again; suiteshuffle the same in a
#            shuffled order (PYTEST_SHUFFLE_SEED, default 1)
#   kernel   the loss-kernel benchmark (GRPO and the other objectives at 16,384 x 152,064); KERNEL_TREE=DIR
#            runs it a second time from another checkout (kernel-tree.json: a before/after pair)
#   tree     the trainer benchmark on the e2e workload's shapes: flat against tree and group packing
#   e2e1     configs/gpu-1.yaml, 10 steps per rollout.update mode in E2E_MODES (default drain,inflight),
#            back to back (e2e benchmark: steady state past --warmup 3; s/step, learner busy, NVML)
#   tracegsm configs/gpu-1-gsm8k.yaml as shipped for 12 steps with metrics.profile on (steps 8-9 traced in each role and
#            up to metrics.profile_engine_steps engine steps in vLLM's engine core): their summaries
#            (scripts/trace_summary.py: GPU busy and idle per trace, kernel families, host regions) in tracegsm.json;
#            where an engine step's 6-7 ms go (~3 min); trace7b the same on configs/gpu-1-7b.yaml (trace7b.json: the
#            learner's recomputed forward, the engine step beside it; ~5 min); TRACE_SET adds overrides (k=v ...)
#   e2egsm   configs/gpu-1-gsm8k.yaml the same (eval off; GSM8K_MODEL=/path sets model.path, else the
#            0.5B shape with random weights: every completion runs to 256 tokens)
#   e2e7b    configs/gpu-1-7b.yaml the same
#            E2E1_ORDER / E2EGSM_ORDER / E2E7B_ORDER replace the modes with jobs of the e2e benchmark's
#            --order (e.g. "async+old,async"), their variants in E2E_VARIANTS ("old:k=v,k=v new:k=v");
#            E2E_BASELINE_TREE=DIR runs the jobs named JOB@base from another checkout (before/after code)
#            Each job runs the processes its config fixes (gpu-1.yaml, gpu-1-7b.yaml: 2; gpu-1-gsm8k.yaml: 3, two
#            engines and the learner); a variant setting topology.num_inference changes it (gsm8k's one engine:
#            "one:topology.num_inference=1,engine.gpu_memory_utilization=0.25,engine.kv_cache_gib=8", 2 processes)
#   e2ecanary the canary's cost on configs/gpu-1-gsm8k.yaml: a warm-up job (on@warm: compile caches, GPU
#            clocks; counted nowhere), then six jobs of sync.canary_every 1 and 0 (on,off,off,on,on,off:
#            three adjacent on/off pairs, their s/step ratios' mean and standard error and the pooled ratio in
#            the record's figures, each job's probe ms per side); E2ECANARY_ORDER replaces the order,
#            E2E_STEPS the steps per job (default 20 here, as each job's start-up dominates; others 10)
#   e2ecanary2  the canary's cost within one job: a short warm job, then sync.canary_every=2 (the canary on every
#            other version) and a canary_every=0 control, E2ECANARY2_STEPS steps each (default 60): each job's
#            even/odd step gap over its mean step, with its standard error (`benchmarks/e2e.py`); ~7 min
#   probe    the canary's learner probe alone (`--profile probe`, gpu-1-gsm8k's learner): device and host ms per
#            variant (as run, eager, no FSDP, no compile, flat), each beside a busy second CUDA context too;
#            5-8 min (no build starts after PROBE_LIMIT_S, default 540); PROBE_ARGS adds arguments, e.g.
#            "--variants as_run,eager,no_compile --iters 20" (2-3 min)
#   pyc      whether the bundle's modules import from cached bytecode (a pip install writes it; the bundle is
#            unpacked wheels): a fresh `import vllm` twice, `compileall` of the bundle, twice again, and the
#            slowest imports (pyc.log); run it first: what follows then imports from bytecode, as a user's would
#   startupgsm  the startup profile on configs/gpu-1-gsm8k.yaml as shipped: a cold launch (fresh compile cache),
#            then a warm one, STARTUP_STEPS steps each (default 6), timelines side by side (startupgsm.json);
#            startup7b the same on configs/gpu-1-7b.yaml; STARTUP_SET adds overrides (k=v ...); startupgsm:K=V
#            (or startup7b:K=V) the same with one more override, e.g. startupgsm:learner.compile=false (no comma:
#            ONE_STEPS splits on commas)
#            (startupgsm-learner-compile-false.json; each launch's log and startup.json under NAME-runs/): each
#            about 4 min on gpu-1-gsm8k.yaml; STARTUP_ARGS adds
#            profile arguments, e.g. STARTUP_ARGS=--importtime (every process's imports, vLLM's engine core too)
#   startupab  the startup profile on configs/gpu-1-gsm8k.yaml, this tree against a base tree in one run: each
#            cold in its own fresh cache, then STARTUP_PAIRS (default 1) rounds of warm runs base, ours, ours,
#            base (startupab.json, ~8 min); BASE_TGZ: `git archive --format=tar.gz` of the base commit, carried
#            with the call that starts the chain (e.g. carry .baseline, BASE_TGZ=.baseline/base-COMMIT.tar.gz)
#   learn    the GPU learning test: cpu-tiny on vLLM reaches 0.9 with drain and with inflight (learnmask:
#            only with engine.constraint_masks=ours)
#   flame    py-spy flame graphs of configs/gpu-1.yaml's (or FLAME_CONFIG's) ranks and vLLM engine core,
#            FLAME_DELAY s (default 150: past start-up and warm-up) into the run, for 40 s (flame/*.svg);
#            FLAME_SET adds overrides ("--engine.lora_mode=merged ..."), FLAME_FORMAT flamegraph.sh's --format,
#            FLAME_ALSO its --also (gil,idle)
#   dsroll   the dataset_rollout benchmark as shipped (ours against plain vLLM, 7B shape); DSROLL_SIDES
#            picks its --sides (default vllm,ours), DSROLL_VARIANTS its --variant ("name:k=v ...");
#            dsroll05 the same at the 0.5B shape
#   dsrollfp8  the dataset_rollout benchmark at the 7B shape, FP8 against bf16 in one run (issue 62): by default
#            our engine bf16 (merged, as shipped: ours), FP8 merged (ours+fp8m: W0 in e4m3, requantized at each
#            sync) and plain vLLM FP8; further sides: bf16 slot (ours+slot), FP8 slot (ours+fp8), plain vLLM
#            bf16 (vllm); ratios ours+fp8m over ours (>= 1.3 wanted) and over vllm_fp8 (>= 0.95); DSROLLFP8_SIDES
#            picks the sides (set DSROLLFP8_RATIOS to pairs of the sides kept); DSROLLFP8_ARGS adds arguments,
#            e.g. "--questions 64" (512 sequences a round, as an engine of the multi-GPU presets keeps)
#   dsrolltrace  the dataset_rollout benchmark at the 7B shape and 512 sequences, ours (bf16) and ours+fp8m: one
#            timed round each, then one traced round of each engine core (`--trace-dir`, 64 engine steps), the
#            traces summarized (dsrolltrace-summary.json: kernel families per side; ~6 min)
#   parityfp8  the parity step with the engine in FP8 (--quantization fp8): the engine-vs-learner log-prob gap
#            of an FP8 engine (parity-7b-fp8.json beside parity's parity-7b.json: run parity,parityfp8)
#   learnfp8 the GPU learning test with FP8: cpu-tiny on vLLM with engine.quantization=fp8 and loss.tis_cap=2
#            reaches 0.9 with the canary under its FP8 bound (slot and merged), and an FP8 engine that skips updates
#            is caught (slot and merged)
#   parity   vLLM's sampled-token log-probs against the learner's at the 7B shape, both on the GPU (the sync
#            profile's parity part: constrained, Diplomacy, unconstrained; LoRA slot); paritymask: the
#            same at the 0.5B shape with engine.constraint_masks=ours
#   canary   the sync canary on vLLM: an engine that skips updates is caught in slot and merged mode
#            (exit 3), and a healthy 300-step learning run stays under its bound (drain, vLLM masks)
#   masks    the constraint-mask kernel's GPU test (against its PyTorch reference)
#   logprob  the sampled-token log-prob kernel: its GPU parity test (against vLLM's sampler function
#            too) and `--profile logprob` (vLLM's against ours, device ms per decode step); lpcalls: only
#            the test that a running engine's sampler calls reach the kernel
# SOAK="ARGS" runs `scripts/benchmark.py --profile soak ARGS` on the CPU beside the chain (no GPU:
# CUDA_VISIBLE_DEVICES empty), pinned to cores SOAK_CORES (default 6-15) while the chain keeps
# CHAIN_CORES (0-5); SOAK_1, SOAK_2, ... run more soaks at once (SOAK_1_CORES, ... pin each apart),
# each cut at SOAK_TIMEOUT seconds (default 14400; its JSON is written at the end).
# Each job's GPU memory per process is sampled by nvidia-smi every 2 s (mem-*.csv: the peak per role).
set -u
GS=${GS:-/tmp/gs1}
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

e2e_jobs() {  # e2e_jobs NAME CONFIG [OVERRIDES...]: 10 steps per job, back to back, one record
  local name=$1 config=$2 order="" variants=() m order_var
  shift 2
  order_var=$(echo "${name}_ORDER" | tr '[:lower:]' '[:upper:]')
  if [ -n "${!order_var:-}" ]; then  # e.g. E2E1_ORDER="async+old,async" with E2E_VARIANTS="old:k=v,k=v ..."
    order=${!order_var}; read -r -a variants <<< "${E2E_VARIANTS:-}"
  else
    for m in $(echo "${E2E_MODES:-drain,inflight}" | tr , ' '); do
      order="$order${order:+,}async+$m"; variants+=("$m:rollout.update=$m")
    done
  fi
  with_memory "$name" timeout 3000 python3 scripts/benchmark.py --profile e2e --config "$config" \
    --steps "${E2E_STEPS:-10}" --warmup 3 --order "$order" ${variants[@]:+--variant "${variants[@]}"} --set checkpoint.enabled=false "$@" \
    --out "$GS/$name.json" --partial "$GS/partial-$name.json" ${E2E_BASELINE_TREE:+--baseline-tree "$E2E_BASELINE_TREE"}
}

startup_profile() {  # startup_profile STEP NAME [K=V]: the startup profile on STEP's preset, launched cold then warm
  local cfg=configs/gpu-1-gsm8k.yaml; [ "$1" = startup7b ] && cfg=configs/gpu-1-7b.yaml
  local sets=() args=()
  read -r -a sets <<< "${STARTUP_SET:-}"
  [ -n "${3:-}" ] && sets+=("$3")
  [ ${#sets[@]} -gt 0 ] && args=(--set "${sets[@]}")
  with_memory "$2" timeout 1200 python3 scripts/benchmark.py --profile startup --config "$cfg" \
    --steps "${STARTUP_STEPS:-6}" --out "$GS/$2.json" ${STARTUP_ARGS:-} ${args[@]+"${args[@]}"}
  local d  # each launch's log and startup.json come back with the chain's results
  for d in /tmp/colocate-startup-*; do
    [ -d "$d" ] || continue
    mkdir -p "$GS/$2-runs"
    (cd "$d" && find . -maxdepth 2 \( -name '*.log' -o -name startup.json \) -exec cp --parents {} "$GS/$2-runs/" \;)
    rm -rf "$d"
  done
}

trace_preset() {  # trace_preset NAME CONFIG: CONFIG as shipped, 12 steps, steps 8-9 traced in every role and in vLLM's
  local name=$1 config=$2 prof="$GS-traces-$1" sets=()  # engine core; traces stay beside $GS, not in it
  rm -rf "$prof" "$GS/run-$name"                                   # (too large to come back): their summaries do
  [ "$name" = tracegsm ] && [ -n "${GSM8K_MODEL:-}" ] && sets=("--model.path=$GSM8K_MODEL")
  local extra=()
  read -r -a extra <<< "${TRACE_SET:-}"
  [ ${#extra[@]} -gt 0 ] && sets+=("${extra[@]/#/--}")
  with_memory "$name" timeout 900 python3 -m colocate.cli train --config "$config" \
    --learner.num_steps=12 --eval.every=0 --eval.at_end=false --metrics.profile=true --metrics.profile_wait=6 \
    --metrics.profile_dir="$prof" --metrics.run_dir="$GS/run-$name" ${sets[@]+"${sets[@]}"}
  summarize_traces "$name" "$prof"
}

summarize_traces() {  # summarize_traces NAME DIR: every trace under DIR summarized into $GS/NAME.json
  local name=$1 prof=$2 traces rc
  traces=$(find "$prof" -name "*.json*" 2>/dev/null | sort)
  if [ -z "$traces" ]; then
    echo "$name: no traces under $prof" >> "$GS/chain.log"
    return
  fi
  python3 scripts/trace_summary.py $traces > "$GS/$name.json" 2>> "$GS/$name.log"
  rc=$?
  echo "$name: $(echo "$traces" | wc -l) traces, trace_summary rc=$rc ($name.json)" >> "$GS/chain.log"
}

FP8M_VARIANT="fp8m:engine.quantization=fp8,engine.lora_mode=merged,loss.tis_cap=2.0"  # FP8 merged, as the presets

dsroll_trace() {  # the 7B dataset rollout at 512 sequences, bf16 and FP8 merged: one timed round, then one traced
  local prof="$GS-traces-dsroll"
  rm -rf "$prof"
  with_memory dsrolltrace timeout 1800 python3 scripts/benchmark.py --profile dataset_rollout --sides ours,ours+fp8m \
    --variant "$FP8M_VARIANT" --questions 64 --rounds 1 \
    --trace-dir "$prof" --out "$GS/dataset-rollout-trace.json"
  summarize_traces dsrolltrace-summary "$prof"
}

pyc_check() {  # whether the bundle's modules import from cached bytecode, and what a fresh import of vLLM costs
  local site
  site=$(python3 -c "import os, vllm; print(os.path.dirname(os.path.dirname(vllm.__file__)))" 2>/dev/null)
  [ -n "$site" ] || { echo "pyc: vLLM does not import" >> "$GS/chain.log"; return; }
  {
    echo "PYTHONDONTWRITEBYTECODE=${PYTHONDONTWRITEBYTECODE:-unset} site=$site"
    echo "vllm __pycache__ dirs: $(find "$site/vllm" -name __pycache__ -type d | wc -l)"
    local i TIMEFORMAT
    for i in 1 2; do TIMEFORMAT="import vllm, fresh process $i: %R s"; time python3 -c "import vllm"; done
    TIMEFORMAT="compileall of $site: %R s"; time python3 -m compileall -q -j 0 "$site" > /dev/null
    echo "vllm __pycache__ dirs: $(find "$site/vllm" -name __pycache__ -type d | wc -l)"
    for i in 1 2; do TIMEFORMAT="import vllm after compileall $i: %R s"; time python3 -c "import vllm"; done
    python3 -X importtime -c "import vllm" 2>&1 | sort -t'|' -k2 -n | tail -15
  } > "$GS/pyc.log" 2>&1
  grep -E "import vllm|compileall|pycache|DONTWRITE" "$GS/pyc.log" >> "$GS/chain.log"
}

step() {  # one step of the chain, by name
  local gsm_model=()
  [ -n "${GSM8K_MODEL:-}" ] && gsm_model=("model.path=$GSM8K_MODEL")
  case $1 in
    test) with_memory test timeout 600 python3 -m pytest -q -m gpu tests/test_shared_gpu.py -p no:cacheprovider ;;
    gpu1) with_memory gpu1 timeout 900 torchrun --nproc-per-node 2 -m colocate.train --config configs/gpu-1.yaml \
            --learner.num_steps=10 --metrics.run_dir=$GS/run-gpu1 ;;
    sync) with_memory sync timeout 700 python3 scripts/benchmark.py --profile sync --one-gpu --shape 7b \
            --budget-s 420 --out "$GS/sync-7b-1gpu.json" ;;
    syncfp8m) for q in none fp8; do
              with_memory "syncm-$q" timeout 600 python3 scripts/benchmark.py --profile sync --one-gpu --shape 7b \
                --lora-mode merged --quantization "$q" --iters 10 --budget-s 300 --out "$GS/sync-7b-merged-$q.json"
            done ;;
    gpu1-7b) with_memory gpu1-7b timeout 1200 torchrun --nproc-per-node 2 -m colocate.train \
            --config configs/gpu-1-7b.yaml --learner.num_steps=5 --metrics.run_dir=$GS/run-gpu1-7b ;;
    gpu1-7b-tree) with_memory gpu1-7b-tree timeout 1200 torchrun --nproc-per-node 2 -m colocate.train \
            --config configs/gpu-1-7b.yaml --learner.num_steps=5 --learner.prefix_sharing=tree \
            --metrics.run_dir=$GS/run-gpu1-7b-tree ;;
    prefixtest) with_memory prefixtest timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider \
            tests/test_prefix_sharing.py ;;
    gputests) with_memory gputests timeout 900 python3 -m pytest -q -rA -m gpu -p no:cacheprovider \
            tests/test_kernel_bulk.py tests/test_kernel_triton.py tests/test_prefix_sharing.py \
            tests/test_packing.py tests/test_shared_gpu.py tests/test_loss_reference.py ;;
    suite|suite2) with_memory "$1" timeout 1500 python3 -m pytest -q -rfEs --durations=25 -m gpu -p no:cacheprovider \
            --junitxml="$GS/$1.xml" tests
          grep -E "(passed|failed|error)" "$GS/$1.log" | tail -1 >> "$GS/chain.log" ;;
    suiteshuffle) PYTEST_SHUFFLE_SEED=${PYTEST_SHUFFLE_SEED:-1} with_memory suiteshuffle timeout 1500 python3 -m pytest \
            -q -rfEs --durations=25 -m gpu -p no:cacheprovider --junitxml="$GS/suiteshuffle.xml" tests
          grep -E "(passed|failed|error)" "$GS/suiteshuffle.log" | tail -1 >> "$GS/chain.log" ;;
    kernel) with_memory kernel timeout 600 python3 scripts/benchmark.py --profile kernel --iters 20 --no-compile \
            --out "$GS/kernel.json"
          if [ -n "${KERNEL_TREE:-}" ]; then
            (cd "$KERNEL_TREE" && with_memory kernel-tree timeout 600 python3 scripts/benchmark.py --profile kernel \
              --iters 20 --no-compile --out "$GS/kernel-tree.json")
          fi ;;
    tree) with_memory tree timeout 600 python3 scripts/benchmark.py --profile trainer --num-gpus 1 \
            --seqs-per-rank 448 --group-size 2 --budgets 16384 --prefix-sharing tree,group --padded-batch 0 \
            --sdpa-budget 0 --ac-budget 0 --time-limit-s 480 --out "$GS/trainer-tree.json" ;;
    pyc) pyc_check ;;
    startupgsm|startup7b) startup_profile "$1" "$1" ;;
    startupab) rm -rf /tmp/base-tree && mkdir -p /tmp/base-tree \
            && tar xzf "${BASE_TGZ:?BASE_TGZ: the base tree as a git archive}" -C /tmp/base-tree \
            && STARTUP_ARGS="${STARTUP_ARGS:-} --baseline-tree /tmp/base-tree --pairs ${STARTUP_PAIRS:-1}" \
              startup_profile startupgsm startupab ;;
    startupgsm:*|startup7b:*) startup_profile "${1%%:*}" "${1%%:*}-$(printf %s "${1#*:}" | tr -c 'A-Za-z0-9' '-')" "${1#*:}" ;;
    probe) with_memory probe timeout 900 python3 scripts/benchmark.py --profile probe --config configs/gpu-1-gsm8k.yaml \
      ${gsm_model[@]:+--set "${gsm_model[@]}"} --time-limit-s "${PROBE_LIMIT_S:-540}" ${PROBE_ARGS:-} \
      --trace-dir "$GS/probe-traces" --partial "$GS/partial-probe.json" --out "$GS/probe.json" ;;
    e2ecanary2) E2ECANARY2_ORDER=${E2ECANARY2_ORDER:-"async+two+short@warm,async+two,async+zero"} \
      E2E_VARIANTS="two:sync.canary_every=2 zero:sync.canary_every=0 short:learner.num_steps=10" \
      e2e_jobs e2ecanary2 configs/gpu-1-gsm8k.yaml eval.every=0 eval.at_end=false "${gsm_model[@]}" --steps "${E2ECANARY2_STEPS:-60}" ;;
    tracegsm) trace_preset tracegsm configs/gpu-1-gsm8k.yaml ;;
    trace7b) trace_preset trace7b configs/gpu-1-7b.yaml ;;
    dsrolltrace) dsroll_trace ;;
    e2e1) e2e_jobs e2e1 configs/gpu-1.yaml ;;
    e2egsm) e2e_jobs e2egsm configs/gpu-1-gsm8k.yaml eval.every=0 eval.at_end=false "${gsm_model[@]}" ;;
    e2e7b) e2e_jobs e2e7b configs/gpu-1-7b.yaml ;;
    e2ecanary) E2ECANARY_ORDER=${E2ECANARY_ORDER:-"async+on@warm,async+on,async+off,async+off,async+on,async+on,async+off"} \
          E2E_VARIANTS="on:sync.canary_every=1 off:sync.canary_every=0" E2E_STEPS=${E2E_STEPS:-20} \
          e2e_jobs e2ecanary configs/gpu-1-gsm8k.yaml eval.every=0 eval.at_end=false "${gsm_model[@]}" ;;
    learn) with_memory learn timeout 2000 python3 -m pytest -q -m gpu -p no:cacheprovider \
            "tests/test_vllm_gpu.py::test_cpu_tiny_learns_with_vllm_on_one_gpu" ;;
    learnmask) with_memory learnmask timeout 900 python3 -m pytest -q -m gpu -p no:cacheprovider \
            "tests/test_vllm_gpu.py::test_cpu_tiny_learns_with_vllm_on_one_gpu[drain-ours]" ;;
    flame) with_memory flame timeout 900 bash scripts/flamegraph.sh --delay "${FLAME_DELAY:-150}" --duration 40 \
            --format "${FLAME_FORMAT:-flamegraph}" ${FLAME_ALSO:+--also $FLAME_ALSO} \
            --out "$GS/flame" -- torchrun --nproc-per-node 2 -m colocate.train --config "${FLAME_CONFIG:-configs/gpu-1.yaml}" \
            --learner.num_steps="${FLAME_STEPS:-40}" --checkpoint.enabled=false --metrics.run_dir=$GS/run-flame \
            ${FLAME_SET:-} ;;
    dsroll) with_memory dsroll timeout 1500 python3 scripts/benchmark.py --profile dataset_rollout \
            --sides "${DSROLL_SIDES:-vllm,ours}" ${DSROLL_VARIANTS:+--variant $DSROLL_VARIANTS} \
            --out "$GS/dataset-rollout.json" ;;
    dsroll05) with_memory dsroll05 timeout 900 python3 scripts/benchmark.py --profile dataset_rollout \
            --sides "${DSROLL_SIDES:-vllm,ours}" ${DSROLL_VARIANTS:+--variant $DSROLL_VARIANTS} \
            --shape qwen2.5-0.5b --out "$GS/dataset-rollout-05b.json" ;;
    dsrollfp8) with_memory dsrollfp8 timeout 2700 python3 scripts/benchmark.py --profile dataset_rollout \
            --sides "${DSROLLFP8_SIDES:-ours,ours+fp8m,vllm_fp8}" \
            --variant "slot:engine.lora_mode=slot" "fp8:engine.quantization=fp8,engine.lora_mode=slot,loss.tis_cap=2.0" \
              "$FP8M_VARIANT" \
            --ratios "${DSROLLFP8_RATIOS:-ours+fp8m/ours,ours+fp8m/vllm_fp8}" ${DSROLLFP8_ARGS:-} \
            --out "$GS/dataset-rollout-fp8.json" ;;
    parityfp8) with_memory parityfp8 timeout 600 python3 scripts/benchmark.py --profile sync --one-gpu --shape 7b \
              --iters 3 --also parity --budget-s 400 --quantization fp8 --out "$GS/parity-7b-fp8.json" ;;
    learnfp8) with_memory learnfp8 timeout 2000 python3 -m pytest -q -rA -m gpu -p no:cacheprovider \
            "tests/test_vllm_gpu.py::test_cpu_tiny_learns_with_vllm_fp8_and_tis_on_one_gpu" \
            "tests/test_vllm_gpu.py::test_canary_catches_an_engine_that_skips_updates[fp8]" \
            "tests/test_vllm_gpu.py::test_canary_catches_an_engine_that_skips_updates[fp8-merged]" ;;
    parity) with_memory parity timeout 600 python3 scripts/benchmark.py --profile sync --one-gpu --shape 7b \
              --iters 3 --also parity --budget-s 400 --out "$GS/parity-7b.json" ;;
    paritymask) with_memory paritymask timeout 600 python3 scripts/benchmark.py --profile sync --one-gpu \
              --shape 0.5b --iters 3 --also parity --budget-s 400 --constraint-masks ours \
              --out "$GS/parity-05b-masks.json" ;;
    canary) with_memory canary timeout 2400 python3 -m pytest -q -rA -m gpu -p no:cacheprovider \
            "tests/test_vllm_gpu.py::test_canary_catches_an_engine_that_skips_updates" \
            "tests/test_vllm_gpu.py::test_cpu_tiny_learns_with_vllm_on_one_gpu[drain-vllm]" ;;
    masks) with_memory masks timeout 600 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_constraint_masks.py ;;
    lpcalls) with_memory lpcalls timeout 600 python3 -m pytest -q -m gpu -p no:cacheprovider \
              "tests/test_vllm_gpu.py::test_running_engine_takes_log_probs_from_our_kernel" ;;
    logprob) with_memory logprob-test timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider \
            tests/test_sampled_logprob.py "tests/test_vllm_gpu.py::test_running_engine_takes_log_probs_from_our_kernel"
          with_memory logprob timeout 300 python3 scripts/benchmark.py --profile logprob --out "$GS/logprob.json" ;;
    *) echo "== unknown step $1" >> "$GS/chain.log" ;;
  esac
}

chain() {
  cd "$1" || exit 1
  local pids=() v cores cores_var
  for v in $(compgen -v SOAK); do  # CPU soaks beside the chain, on their own cores, off the GPU
    case $v in SOAK|SOAK_[0-9]|SOAK_[0-9][0-9]) ;; *) continue ;; esac
    cores_var=${v}_CORES
    cores=${!cores_var:-${SOAK_CORES:-6-15}}
    ( eval "CUDA_VISIBLE_DEVICES= taskset -c $cores timeout ${SOAK_TIMEOUT:-14400} python3 scripts/benchmark.py \
        --profile soak ${!v} \
        --out $GS/soak-${v,,}.json" > "$GS/soak-${v,,}.log" 2>&1
      echo "== $(date +%T) soak $v rc=$?" >> "$GS/chain.log" ) &
    pids+=($!)
  done
  [ ${#pids[@]} -gt 0 ] && taskset -p -c "${CHAIN_CORES:-0-5}" $$ > /dev/null  # the GPU steps keep their cores
  for s in $(echo "${ONE_STEPS:-test,gpu1,sync,gpu1-7b}" | tr , ' '); do
    echo "== $(date +%T) $s start" >> "$GS/chain.log"
    step "$s"
  done
  [ ${#pids[@]} -gt 0 ] && wait "${pids[@]}"
  echo "chain done" >> "$GS/chain.log"
}
export -f chain step with_memory e2e_jobs startup_profile pyc_check trace_preset summarize_traces dsroll_trace
export GS FP8M_VARIANT

table() {  # the e2e records so far: one row per config and mode
  python3 - "$GS" <<'PY'
import glob, json, os, sys
paths = sorted(glob.glob(os.path.join(sys.argv[1], "e2e*.json")))


def learner_probe(r):  # a forward of its own (LoRA dropout; older trees) or riding the step's first forward
    if "canary_learner_ms_mean" in r:
        return f"{r['canary_learner_ms_mean']:.1f}"
    return "rode" if r.get("canary_probes") else "nan"


if paths:
    print(f"{'config':<22} {'job':<9} {'s/step':>7} {'learner busy':>13} {'GPU util':>9} {'dropped':>8} {'step ms':>8} "
          f"{'tok/step':>8} {'canary learner/engine ms':>25}")
for path in paths:
    record = json.load(open(path))
    for job, r in record.get("failed", {}).items():
        print(f"{os.path.basename(record['config']):<22} {job.split('+')[-1]:<9} failed: {r['error'][-200:]!r}")
    for job, r in record["runs"].items():
        util = r.get("inference_nvml_busy") or r.get("learner_nvml_busy")
        print(f"{os.path.basename(record['config']):<22} {job.split('+')[-1]:<9} {r['seconds_per_step']:>7.2f} "
              f"{100 * r['learner_busy_fraction']:>12.0f}% {'' if util is None else f'{100 * util:.0f}%':>9} "
              f"{r['dropped_stale']:>8.0f} {r.get('rollout_step_ms', float('nan')):>8.1f} "
              f"{r.get('rollout_tokens_per_step', float('nan')):>8.1f} "
              f"{learner_probe(r):>12}/{r.get('canary_engine_ms_mean', float('nan')):<12.1f}")
    for key, v in record.get("figures", {}).items():  # two jobs alternating: their pairs (e2e benchmark)
        if key.endswith(("_pairs", "_pair_mean", "_pair_se", "_pooled", "_parity_gap_frac", "_parity_gap_frac_se")):
            print(f"{'':<22} {key:<60} {v}")
for path in sorted(glob.glob(os.path.join(sys.argv[1], "dataset-rollout*.json"))):
    record = json.load(open(path))
    detail = record["figures"]["detail"]
    print(f"{os.path.basename(path):<28} {'side':<14} {'out tok/s':>10} {'ms/step':>8} {'steps':>6} {'outside s':>10}")
    for side, d in detail.items():
        print(f"{'':<28} {side:<14} {d['out_tokens_per_s']:>10.0f} {d.get('engine_ms_per_step', 0):>8.2f} "
              f"{d.get('engine_steps_per_round', 0):>6.0f} {d.get('outside_engine_s', 0):>10.3f} {d.get('logprob_calls', '')}")
    for name, ratio in record.get("ratios", {}).items():  # out tokens/s, A over B
        print(f"{'':<28} {name:<40} {ratio:.3f}")


def leaves(d, prefix=""):
    for k, v in d.items():
        yield from leaves(v, f"{prefix}{k}.") if isinstance(v, dict) else [(prefix + k, v)]


after, before = (os.path.join(sys.argv[1], f) for f in ("kernel.json", "kernel-tree.json"))
if os.path.exists(after) and os.path.exists(before):  # a before/after pair: device ms, this tree over KERNEL_TREE's
    a, b = json.load(open(after))["figures"], json.load(open(before))["figures"]
    print(f"{'kernel figure':<40} {'before':>8} {'after':>8} {'ratio':>6}")
    for key in sorted(k for k in a if k.endswith("_gpu_ms") and k in b):
        print(f"{key:<40} {b[key]:>8.3f} {a[key]:>8.3f} {a[key] / b[key]:>6.3f}")

for path in sorted(glob.glob(os.path.join(sys.argv[1], "parity-*.json"))):
    for key, v in leaves(json.load(open(path))):
        if key.endswith(("mean_abs_diff", "/tokens", "/error", "/quantization")):
            print(f"{os.path.basename(path):<22} {key:<56} {v}")
PY
}

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
    for f in "$GS"/*.log; do
      echo "---- $f"; grep -E "step [0-9]+/|\[e2e\]|\[soak\]|summary|colocate:|Error|error|passed|failed" "$f" | tail -n 8 | cut -c1-300
    done
    table | tee "$GS/table.txt"
    mkdir -p "$OUT"
    tar czf "$OUT/one-gpu.tgz" -C "$GS" --exclude='run-*/checkpoints' --exclude='run-*/adapter' --exclude='*.tfevents*' . 2>/dev/null
    ls -la "$OUT" ;;
esac
