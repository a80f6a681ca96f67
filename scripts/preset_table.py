"""The table of `scripts/gpu_presets_session.sh`: per job, launch -> end of step 1, median seconds per
step over steps 3.., both roles' busy shares, and per rank the memory plan's estimate against the
measured peaks (summary.json's `memory_plan_gib` and `memory_peak_gib`).

    python3 scripts/preset_table.py DIR     (DIR holds NAME.launch and NAME-summary.json per job)
"""
import glob
import json
import os
import statistics
import sys


def job_rows(directory: str, name: str) -> tuple[str, list[str]]:
    with open(os.path.join(directory, f"{name}-summary.json")) as f:
        summary = json.load(f)
    with open(os.path.join(directory, f"{name}.launch")) as f:
        launch = float(f.read())
    ends = [row["step_end"] if isinstance(row, dict) else row[3] for row in summary.get("timeline", [])]
    steps = [b - a for a, b in zip(ends, ends[1:])][1:]  # step 3 onwards: step k's end minus step k-1's
    median = statistics.median(steps) if steps else float("nan")
    first = ends[0] - launch if ends else float("nan")
    line = (f"| {name} | {summary['steps']} | {first:.0f} s | {median:.2f} s | "
            f"{summary.get('learner_busy_fraction', float('nan')):.0%} | "
            f"{summary.get('inference_busy_fraction', float('nan')):.0%} |")
    plan, peaks = summary.get("memory_plan_gib", {}), summary.get("memory_peak_gib", {})
    ranks = []
    for rank in sorted(peaks, key=int):
        p = peaks[rank]
        est = plan.get(rank)
        measured = p.get("device_used_at_end", p.get("device_used", p.get("reserved")))  # the whole GPU, as planned
        ratio = f"{est / measured:.2f}" if est and measured else ""
        ranks.append(f"| {name} | {rank} | {est if est is not None else ''} | {p.get('allocated', '')} | "
                     f"{p.get('reserved', '')} | {p.get('device_used_at_end', p.get('device_used', ''))} | {ratio} |")
    return line, ranks


def main(directory: str) -> None:
    names = sorted(os.path.basename(p)[:-len(".launch")] for p in glob.glob(os.path.join(directory, "*.launch")))
    print("| job | steps | launch -> step 1 end | s/step (median, steps 3..) | learners busy | inference busy |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    memory = []
    for name in names:
        try:
            line, ranks = job_rows(directory, name)
        except (OSError, ValueError, KeyError) as e:
            print(f"| {name} | no summary ({type(e).__name__}) | | | | |")
            continue
        print(line)
        memory += ranks
    print("\n| job | rank | plan GiB | allocated peak | reserved peak | NVML used at the end (whole GPU) | plan / measured |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    print("\n".join(memory))


if __name__ == "__main__":
    main(sys.argv[1])
