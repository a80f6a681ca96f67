#!/usr/bin/env python3
"""One benchmark entry: `python scripts/benchmark.py --profile {env,rollout,trainer,e2e,sync,kernel,dataset_rollout,soak,logprob,startup,probe}`.

Each profile lives in `benchmarks/<profile>.py` as `run(args) -> dict` and measures the
baseline and ours in the same process. This entry adds the machine description and writes
`profiles/<profile>-<timestamp>.json` (or `--out`), then prints the figures as a short table.
Format: {"profile", "machine", "args", "figures": {...}, "baseline": {...}, "ratios": {...}}.
"""
import argparse
import importlib
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

PROFILES = ("env", "rollout", "trainer", "e2e", "sync", "kernel", "dataset_rollout", "soak", "logprob", "startup", "probe")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", required=True, choices=PROFILES)
    parser.add_argument("--out", default="", help="JSON path (default profiles/<profile>-<time>.json)")
    parser.add_argument("--quick", action="store_true", help="small shapes, for CI and smoke tests")
    args, rest = parser.parse_known_args()
    module = importlib.import_module(f"benchmarks.{args.profile}")
    if hasattr(module, "add_args"):
        sub = argparse.ArgumentParser()
        module.add_args(sub)
        args = sub.parse_args(rest, namespace=args)
    elif rest:
        parser.error(f"unknown arguments {rest}")
    from benchmarks.common import machine_info, print_table
    result = module.run(args)
    record = {"profile": args.profile, "machine": machine_info(), "args": {k: v for k, v in vars(args).items()},
              "time": time.strftime("%Y-%m-%dT%H:%M:%S"), **result}
    out = args.out or os.path.join("profiles", f"{args.profile}-{time.strftime('%Y%m%d-%H%M%S')}.json")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(record, f, indent=2, default=str)
    print_table(record)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
