#!/usr/bin/env python3
"""The tables of scripts/bench-density: one per replay mode, one row per policy.

Reads OUT/settings and each run's directory OUT/<mode>-<policy>-r<round>: `cpu` (two
lines, at the start and the end of the run: ns since the epoch, the node's busy CPU ns,
the runtime side's cgroup CPU ns, the sandboxes' cgroup CPU ns), `failed-replays`, and
the replays' JSON reports in
`reports/` (per turn: exec time, the agent's wait for the checkpoint, bytes, class).
A figure over several rounds is the median of the rounds' figures. Exits non-zero,
naming the run, when a run's files are missing or a mode has no off run to compare with.

Usage: bench_density_report.py OUT
"""

import argparse
import json
import pathlib
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_node_report import pct  # noqa: E402

POLICIES = ("off", "crab", "every-turn")
MIB = 1 << 20


def load_run(d):
    """The figures of one run directory."""
    try:
        cpu = [[int(x) for x in line.split()] for line in (d / "cpu").read_text().splitlines() if line.strip()]
        failed = int((d / "failed-replays").read_text())
    except (OSError, ValueError) as e:
        sys.exit(f"bench_density_report: {d}: unfinished or unreadable run ({e})")
    if len(cpu) != 2 or any(len(sample) != 4 for sample in cpu):
        sys.exit(f"bench_density_report: {d / 'cpu'}: expected two samples of four numbers")
    (t0, node0, side0, sandboxes0), (t1, node1, side1, sandboxes1) = cpu
    latency, delay, classes = [], [], {}
    turns = bytes_ = errors = 0
    for path in sorted((d / "reports").glob("*.json")):
        for report in json.loads(path.read_text()):
            for run in report["runs"]:
                charged = run.get("checkpoint_charged_bytes", run["checkpoint_bytes"])
                bytes_ += charged
                previous_wait = 0.0
                for turn in run["turns"]:
                    turns += 1
                    errors += turn.get("checkpoint_error") is not None
                    latency.append(turn["exec_s"] + previous_wait)
                    previous_wait = turn["agent_visible_delay_s"]
                    delay.append(previous_wait)
                    if turn.get("checkpoint_class"):
                        classes[turn["checkpoint_class"]] = classes.get(turn["checkpoint_class"], 0) + 1
    side = (side1 - side0) / 1e9
    return dict(wall=(t1 - t0) / 1e9, node_cpu=(node1 - node0) / 1e9, side_cpu=side,
                cpu=side + (sandboxes1 - sandboxes0) / 1e9,
                turns=turns, bytes=bytes_, errors=errors, failed=failed, classes=classes,
                p50=pct(latency, 0.50), p99=pct(latency, 0.99), delay_p99=pct(delay, 0.99))


def median_of(runs, key):
    return statistics.median(r[key] for r in runs)


def fmt(value, spec):
    return "-" if value is None or value != value else spec.format(value)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=pathlib.Path, help="the bench's output directory")
    out = parser.parse_args().out
    settings = dict(line.split("=", 1) for line in (out / "settings").read_text().splitlines() if "=" in line)
    rounds = int(settings["rounds"])
    # Runs before the policies were a setting ran all three.
    policies = [p for p in POLICIES if p in settings.get("policies", " ".join(POLICIES)).split()]
    print(f"# bench-density: {settings['size']} sandboxes, {settings['turns']} turns each, think x"
          f"{settings['think_scale']}, started {settings.get('stagger_s', '0')} s apart, {rounds} round(s), "
          f"commit {settings.get('commit', '?')}")
    for mode in settings["modes"].split():
        runs = {p: [load_run(out / f"{mode}-{p}-r{r}") for r in range(1, rounds + 1)] for p in policies}
        base_cpu, base_side = median_of(runs["off"], "cpu"), median_of(runs["off"], "side_cpu")
        base_p99 = median_of(runs["off"], "p99")
        ckpt = {p: median_of(rs, "cpu") - base_cpu for p, rs in runs.items()}
        print()
        print(f"## {mode} mode")
        print()
        print("| policy | turns | clean/fs/proc | wall s | CPU s | checkpoint CPU s | per turn ms "
              "| vs every-turn | runtime side s | node CPU s | latency p50 s | p99 s | p99 inflation | wait p99 s "
              "| bytes | failed replays / checkpoints |")
        print("|" + "---|" * 16)
        for p, rs in runs.items():
            turns = median_of(rs, "turns")
            classes = rs[0]["classes"]
            cls = "/".join(str(classes.get(c, 0)) for c in ("clean", "fs", "proc")) if classes else "-"
            is_off = p == "off"
            per_turn = None if is_off or not turns else ckpt[p] / turns * 1e3
            vs = ckpt[p] / ckpt["every-turn"] if p == "crab" and ckpt.get("every-turn", 0) > 0 else None
            p99 = median_of(rs, "p99")
            print(f"| {p} | {turns:.0f} | {cls} | {median_of(rs, 'wall'):.0f} | {median_of(rs, 'cpu'):.1f} "
                  f"| {fmt(None if is_off else ckpt[p], '{:.1f}')} | {fmt(per_turn, '{:.0f}')} | {fmt(vs, '{:.3f}')} "
                  f"| {fmt(None if is_off else median_of(rs, 'side_cpu') - base_side, '{:.1f}')} "
                  f"| {median_of(rs, 'node_cpu'):.1f} "
                  f"| {median_of(rs, 'p50'):.3f} | {p99:.3f} "
                  f"| {fmt(None if is_off else p99 / base_p99 - 1, '{:+.1%}')} | {median_of(rs, 'delay_p99'):.3f} "
                  f"| {median_of(rs, 'bytes') / MIB:.1f} MiB "
                  f"| {sum(r['failed'] for r in rs)} / {sum(r['errors'] for r in rs)} |")
    print()
    print("CPU: the runtime side's (containerd, shims, runc, CRIU, crabd, the replays: their cgroup) and the "
          "sandboxes' own, during the run. Checkpoint CPU: that minus the off run's (same traces, commands and "
          "think times). Runtime side: the runtime side's part of it. Node CPU: the whole node's busy CPU, other "
          "work included. Turn latency: exec time plus the "
          "wait for the previous turn's checkpoint beyond the think time. Classes: crab's. Bytes: crab's charged "
          "bytes (what its chains reference), every-turn's checkpoints and their exported copies.")


if __name__ == "__main__":
    main()
