#!/usr/bin/env bash
# Hardware counters of the fused GRPO loss row kernels with Nsight Compute, on one GPU.
#   bash scripts/kernel_ncu.sh OUTDIR ['{"block_v": 16384, ...}' ...]
# Profiles, per launch configuration (JSON overrides of triton_rows.default_config; none = the
# default), one forward-only launch (the Triton kernel) and one fused in-place launch (the bulk-copy
# CUDA kernel where the config's backend picks it) at 16384 x 152064 bf16 (the benchmark's inputs),
# after a warm-up of each. Writes OUTDIR/ncu.ncu-rep, its details and raw pages as CSV, and prints
# the headline metrics, stall reasons and pipe use per profiled launch.
# Clocks are left alone (--clock-control none).
set -eu
out=${1:?usage: kernel_ncu.sh OUTDIR [CONFIG_JSON ...]}
shift
mkdir -p "$out"
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -n 1)
n_cfg=$(( $# > 0 ? $# : 1 ))
"$ncu" --clock-control none --set full --import-source yes --kernel-name regex:grpo_rows \
  --launch-count $((4 * n_cfg)) -f -o "$out/ncu" \
  python3 - "$@" <<'EOF'
import json, sys
import torch
from benchmarks.kernel import make_inputs
from colocate.kernels.triton_rows import grpo_rows

_, pristine, f, _ = make_inputs(16, 1024, 152064)
x = pristine.clone()
kw = dict(temperature=1.0, eps_low=0.2, eps_high=0.28, beta=0.04)
for cfg in [json.loads(a) for a in sys.argv[1:]] or [{}]:
    for _ in range(2):  # warm-up, then the profiled pair
        grpo_rows(x, f["targets"], f["weights"], f["behaviour"], f["advantages"], f["ref"], None, config=cfg, **kw)
        x.copy_(pristine)
        grpo_rows(x, f["targets"], f["weights"], f["behaviour"], f["advantages"], f["ref"], x, config=cfg, **kw)
        x.copy_(pristine)
    torch.cuda.synchronize()
    print("profiled", cfg or "default", flush=True)
EOF
"$ncu" -i "$out/ncu.ncu-rep" --page details --csv --print-units base > "$out/details.csv"
"$ncu" -i "$out/ncu.ncu-rep" --page raw --csv --print-units base > "$out/raw.csv"
# Each config launches warm-up fwd, warm-up fused, fwd, fused: report the last two of each.
python3 - "$out/details.csv" <<'EOF'
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
want = ["Duration", "DRAM Throughput", "Memory Throughput", "L2 Hit Rate", "Compute (SM) Throughput",
        "Registers Per Thread", "Achieved Occupancy", "Issue Slots Busy", "Executed Ipc Active",
        "Warp Cycles Per Issued Instruction", "L1/TEX Hit Rate", "Mem Busy", "Max Bandwidth",
        "Dynamic Shared Memory Per Block", "Static Shared Memory Per Block"]
by_launch = {}
for r in rows:
    by_launch.setdefault(int(r["ID"]), {})[r["Metric Name"]] = (r["Metric Value"], r["Metric Unit"])
for i, metrics in sorted(by_launch.items()):
    if i % 4 < 2:  # a warm-up launch
        continue
    print(f"-- launch {i}")
    for name in want:
        if name in metrics:
            print(f"   {name}: {metrics[name][0]} {metrics[name][1]}")
EOF
# The pipe utilizations and warp stall reasons, per launch (raw page: one row per launch).
python3 - "$out/raw.csv" <<'EOF'
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
for i, r in enumerate(rows[1:]):  # rows[0] holds the units
    if i % 4 < 2:
        continue
    stalls = {k: float(v) for k, v in r.items()
              if k.startswith("smsp__average_warps_issue_stalled_") and k.endswith("_per_issue_active.ratio")
              and v not in ("", "n/a")}
    top = sorted(stalls.items(), key=lambda kv: -kv[1])[:6]
    pipes = {k: r[k] for k in r if k.startswith("sm__inst_executed_pipe_") and k.endswith("pct_of_peak_sustained_active")
             and r[k] not in ("", "n/a", "0")}
    print(f"-- raw row {i}: stalls", [(k.split("stalled_")[1].split("_per")[0], round(v, 2)) for k, v in top])
    print("   pipes", sorted(((k.split("pipe_")[1].split(".")[0], float(v)) for k, v in pipes.items()),
                          key=lambda kv: -kv[1])[:6])
    for k in ("dram__bytes_read.sum", "dram__bytes_write.sum", "lts__t_sector_hit_rate.pct",
              "lts__t_sector_op_read_hit_rate.pct", "gpu__time_duration.sum"):
        if k in r:
            print(f"   {k} = {r[k]}")
EOF
