#!/usr/bin/env python3
"""The table of scripts/bench-inspector-tax: per phase, subject and workload, the median wall and
CPU (user + system) seconds, their ratios against the `none` phase (no crabd at all) of the same
subject, and for crabd's phases the CPU ratio against the `floor` phase (empty programs on the
inspector's hooks: what crab's programs add to what the hooks alone cost); crabd's attach and
detach times from its log.

Usage: bench_inspector_tax_report.py --samples FILE --rounds N --reps K [--crabd-log FILE --crabd-log-offset BYTES]
  FILE: lines "phase subject workload wall user sys" (seconds); phase `warmup` is left out.
"""

import argparse
import re
import statistics
from collections import defaultdict

WORKLOADS = ("write512", "build", "git", "find")
SUBJECTS = ("host", "runc", "sandbox")


def phase_order(phase):
    kind, _, build = phase.partition("-")
    return ({"none": 0, "floor": 1, "crabd": 2, "idle": 3}.get(kind, 4), build)


def crabd_times(path, offset):
    """attach_ms and detach_ms values crabd logged after `offset`."""
    try:
        with open(path, "rb") as log:
            log.seek(offset)
            text = log.read().decode("utf-8", "replace")
    except OSError:
        return [], []
    # tracing's plain format, ANSI colours included, puts key=value pairs on the line.
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)
    attach = [float(v) for v in re.findall(r"attach_ms=([0-9.]+)", text)]
    detach = [float(v) for v in re.findall(r"detach_ms=([0-9.]+)", text)]
    return attach, detach


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", required=True)
    parser.add_argument("--rounds", required=True)
    parser.add_argument("--reps", required=True)
    parser.add_argument("--crabd-log")
    parser.add_argument("--crabd-log-offset", type=int, default=0)
    a = parser.parse_args()

    wall, cpu = defaultdict(list), defaultdict(list)
    with open(a.samples) as f:
        for line in f:
            fields = line.split()
            if len(fields) != 6 or fields[0] == "warmup":
                continue
            phase, subject, workload = fields[:3]
            w, u, s = map(float, fields[3:])
            wall[(phase, subject, workload)].append(w)
            cpu[(phase, subject, workload)].append(u + s)
    if not wall:
        raise SystemExit(f"{a.samples}: no samples")
    phases = sorted({k[0] for k in wall}, key=phase_order)

    print(f"medians of {a.rounds} rounds x {a.reps} runs; ratio = phase / none (no crabd at all), same subject;")
    print("cpu / floor = crabd phase / floor phase (empty programs on the inspector's hooks), same subject")
    print("host: unwatched host process; runc: unwatched process in a plain runc container;")
    print("sandbox: process in the watched crab sandbox (in `none` and `floor`: a crab container with")
    print("io.crab.policy=off)")
    print()
    print(f"| phase | subject | workload | wall s | cpu s | wall ratio | cpu ratio | cpu / floor |")
    print(f"|---|---|---|---|---|---|---|---|")
    for phase in phases:
        for subject in SUBJECTS:
            for workload in WORKLOADS:
                key = (phase, subject, workload)
                if key not in wall:
                    continue
                mw, mc = statistics.median(wall[key]), statistics.median(cpu[key])
                base = ("none", subject, workload)
                if phase != "none" and base in wall:
                    bw, bc = statistics.median(wall[base]), statistics.median(cpu[base])
                    ratios = f"{mw / bw:.3f} | {mc / bc:.3f}" if bw > 0 and bc > 0 else "- | -"
                else:
                    ratios = "1 | 1" if phase == "none" else "- | -"
                floor = ("floor", subject, workload)
                over_floor = "-"
                if phase.partition("-")[0] in ("crabd", "idle") and floor in cpu:
                    fc = statistics.median(cpu[floor])
                    over_floor = f"{mc / fc:.3f}" if fc > 0 else "-"
                print(f"| {phase} | {subject} | {workload} | {mw:.3f} | {mc:.3f} | {ratios} | {over_floor} |")
    if a.crabd_log:
        attach, detach = crabd_times(a.crabd_log, a.crabd_log_offset)
        if attach:
            print(f"\ncrabd attach: median {statistics.median(attach):.0f} ms of {len(attach)} "
                  f"(min {min(attach):.0f}, max {max(attach):.0f})")
        if detach:
            print(f"crabd detach (in the background): median {statistics.median(detach):.0f} ms of {len(detach)} "
                  f"(min {min(detach):.0f}, max {max(detach):.0f})")


if __name__ == "__main__":
    main()
