#!/usr/bin/env bash
# The vLLM engine's GPU work in one 2 x H200 lease (about 7 minutes), in order of value:
#   1. Qwen2.5-0.5B shape: sync (ours vs disk, checksum), log-prob parity, rollout (vLLM alone / ours / HF)
#   2. Qwen2.5-7B shape, the same (headline figures) - only when step 1 produced its sync figures
#   3. tests/test_vllm_gpu.py (torchrun train with VLLMEngine; the session test when time is left)
# Writes under $OUT: session.log (everything), vllm-0.5b.json, vllm-7b.json, pytest-gpu.log, summary.txt,
# and prints a short table last. Expects vllm & co. on PYTHONPATH (the GPU bundle: DEVELOPERS.md,
# "Measuring on GPUs") and runs from the repository root.
#   usage: BUDGET=520 bash scripts/gpu_vllm_session.sh
set -u
OUT=${OUT:-/tmp/colocate-gpu}
mkdir -p "$OUT"
BUDGET=${BUDGET:-520}
T0=$(date +%s)
left() { echo $((BUDGET - ($(date +%s) - T0))); }
# NVLink multicast stays off (shared hosts); one NCCL memory mode for torch's NCCL and vLLM's PyNccl.
export PYTHONUNBUFFERED=1 NCCL_CUMEM_ENABLE=0 TOKENIZERS_PARALLELISM=false VLLM_USE_FLASHINFER_SAMPLER=0
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
LOG=$OUT/session.log

step() {  # step SECONDS NAME CMD... : full output to the log, the interesting lines to stdout
  local secs=$1 name=$2
  shift 2
  echo "== $(date +%T) $name (limit ${secs}s, ${BUDGET}s budget, $(left)s left)" | tee -a "$LOG"
  timeout -k 15 "$secs" "$@" >>"$LOG" 2>&1
  local rc=$?
  echo "== $(date +%T) $name rc=$rc" | tee -a "$LOG"
  grep -E "^\[vllm-session|Traceback|Error:|error:" "$LOG" | tail -n 8
  return $rc
}

nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a "$LOG"
python3 -c "import torch, vllm, llguidance, transformers, peft; print('torch', torch.__version__, 'vllm', vllm.__version__, 'llguidance', llguidance.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)" 2>&1 | tail -1 | tee -a "$LOG"

COLOCATE_PARTIAL_JSON=$OUT/partial-0.5b.json \
step 170 "0.5b session" python3 scripts/benchmark.py --profile sync --shape 0.5b --also parity \
  --budget-s 130 --num-seqs 512 --out "$OUT/vllm-0.5b.json"

if python3 -c "import json,sys; f=json.load(open(sys.argv[1]))['figures']; sys.exit(0 if f.get('sync/checksum_ok') else 1)" \
    "$OUT/partial-0.5b.json" 2>/dev/null; then
  T7=$(( $(left) - 105 )); [ "$T7" -gt 300 ] && T7=300
  if [ "$T7" -gt 150 ]; then
    COLOCATE_PARTIAL_JSON=$OUT/partial-7b.json \
    step "$T7" "7b session" python3 scripts/benchmark.py --profile sync --shape 7b --also rollout,parity \
      --budget-s $((T7 - 45)) --num-seqs 512 --out "$OUT/vllm-7b.json"
  fi
else
  echo "== 0.5b session gave no sync figures: 7b skipped" | tee -a "$LOG"
fi

TP=$(( $(left) - 10 ))
if [ "$TP" -gt 60 ]; then
  SEL="torchrun"; [ "$TP" -gt 260 ] && SEL="torchrun or session"
  echo "== $(date +%T) pytest ($SEL, ${TP}s)" | tee -a "$LOG"
  timeout -k 10 "$TP" python3 -m pytest -q -x tests/test_vllm_gpu.py -k "$SEL" >"$OUT/pytest-gpu.log" 2>&1
  echo "== pytest rc=$?" | tee -a "$LOG"
  tail -n 25 "$OUT/pytest-gpu.log"
fi

python3 - "$OUT" <<'EOF' | tee "$OUT/summary.txt"
import json, os, sys
out = sys.argv[1]
keys = ["engine/startup_s", "sync/ours_total_ms", "sync/ours_receive_apply_ms", "sync/ours_first_token_ms",
        "sync/first_token_no_update_ms", "sync/disk_total_ms", "sync/speedup_vs_disk", "sync/checksum_ok",
        "sync/slot_matches_received", "sync/engine_bytes_equal_learner", "parity/mean_abs_diff",
        "parity/free_mean_abs_diff", "parity/max_abs_diff", "parity/adapter_effect_mean_abs",
        "parity_diplomacy/free_mean_abs_diff", "parity_unconstrained/mean_abs_diff", "parity/walk_failures",
        "rollout/vllm_alone_out_tok_s", "rollout/ours_out_tok_s", "rollout/ours_vs_vllm_alone",
        "rollout/vllm_unconstrained_out_tok_s", "rollout/hf_generate_out_tok_s", "rollout/ours_vs_hf",
        "diplomacy/ours_vs_vllm_alone", "text_grammar/failure_rate"]
for shape in ("0.5b", "7b"):
    path = os.path.join(out, f"vllm-{shape}.json")
    if not os.path.exists(path):
        path = os.path.join(out, f"partial-{shape}.json")
    if not os.path.exists(path):
        print(f"{shape}: no result"); continue
    rec = json.load(open(path))
    f = {**rec.get("figures", {}), **rec.get("baseline", {}), **rec.get("ratios", {})}
    print(f"--- {shape}")
    for k in keys + [k for k in f if k.endswith("/error") or k.endswith("/skipped")]:
        if k in f:
            v = f[k]
            print(f"{k:40s} {v:.4g}" if isinstance(v, float) else f"{k:40s} {v}")
EOF
