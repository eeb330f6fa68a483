#!/usr/bin/env python3
"""The table of scripts/bench-node: one row per (sandboxes, variant) run under OUT.

Reads each run's directory OUT/<size>-<variant>: the cut traces (think times), the replay
reports (turn latency, checkpoint bytes and time), the store samples and crabd status
samples (sample_store.py), crabd's final status, the failed-replay count; and the turn
records of the run's crab sandboxes in the store (their class, superseded turns).
Columns are explained under the table.

Usage: bench_node_report.py OUT SIZES THINK_SCALE RATE_MIB BURST_MIB STATE_DIR
         HEAVY_RATE_KIB HEAVY_BURST_KIB VARIANTS
  (SIZES and VARIANTS space-separated; OUT/state-dir, when present, overrides STATE_DIR)
"""

import argparse
import json
import pathlib
import re
import statistics
import sys

MIB = 1 << 20


def pct(values, p):
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p * (len(values) - 1))))]


def peak_1s(samples, column):
    """Largest growth over any window of at least 1 s between two samples, per second."""
    peak = 0.0
    for i, s0 in enumerate(samples):
        for s1 in samples[i + 1:]:
            if s1[0] - s0[0] >= 1.0:
                peak = max(peak, (s1[column] - s0[column]) / (s1[0] - s0[0]))
                break
    return peak


def load(out, size, variant, scale, turns_dir):
    d = out / f"{size}-{variant}"
    traces = {}
    for f in (d / "traces").glob("*.jsonl"):
        lines = f.read_text().splitlines()
        traces[json.loads(lines[0])["trace"]] = [json.loads(l).get("think_s", 0.0) for l in lines[1:] if l.strip()]
    latency, delay, ckpt_bytes, turns, errors = [], [], 0, 0, 0
    # (trace, turn) -> (exec time, wait for the previous checkpoint before it)
    paired = {}
    for r in sorted((d / "reports").glob("*.json")):
        for report in json.loads(r.read_text()):
            think = traces.get(report["trace"], [])
            for run in report["runs"]:
                if run["policy"] != "crab":
                    continue
                prev_wait = 0.0
                for t in run["turns"]:
                    turns += 1
                    errors += t.get("checkpoint_error") is not None
                    ckpt_bytes += t["checkpoint_bytes"]
                    latency.append(t["exec_s"] + prev_wait)
                    paired[(report["trace"], t["turn"])] = (t["exec_s"], prev_wait)
                    # The next turn starts after the scaled think time; what the
                    # checkpoint still needs then is the agent's wait.
                    n = t["turn"]
                    next_think = think[n] * scale if n < len(think) else None
                    prev_wait = max(0.0, t["checkpoint_s"] - next_think) if next_think is not None else 0.0
                    if next_think is not None:
                        delay.append(prev_wait)
    samples = []
    for l in (d / "store-samples").read_text().splitlines():
        cols = l.split()
        if len(cols) >= 2:
            samples.append((float(cols[0]), float(cols[1]), float(cols[2]) if len(cols) > 2 else -1.0))
    grown = samples[-1][1] - samples[0][1] if samples else 0
    span = samples[-1][0] - samples[0][0] if samples else 0
    own_device = bool(samples) and samples[0][2] >= 0
    disk = samples[-1][2] - samples[0][2] if own_device else float("nan")
    # Per sandbox, the longest wait crabd reported while the run went on.
    lag = {}
    superseded_draws = 0
    status_file = d / "crabd-samples"
    status_lines = status_file.read_text().splitlines() if status_file.exists() else []
    for line in status_lines:
        try:
            status = json.loads(line)
        except json.JSONDecodeError:
            continue
        superseded_draws = max(superseded_draws, status["bucket"]["superseded"])
        for s in status["bucket"]["sandboxes"]:
            lag[s["sandbox"]] = max(lag.get(s["sandbox"], 0.0), s["max_lag_ms"])
    final = json.loads((d / "crabd-status.json").read_text())
    superseded_draws = max(superseded_draws, final["bucket"]["superseded"])
    for s in final["bucket"]["sandboxes"]:
        lag[s["sandbox"]] = max(lag.get(s["sandbox"], 0.0), s["max_lag_ms"])
    classes, superseded_turns = {}, 0
    for log in (d / "reports").glob("*.log"):
        for container in set(re.findall(r'container="([^"]+-crab)"', log.read_text())):
            path = turns_dir / f"{container}.jsonl"
            if not path.exists():
                # A crab sandbox without a turn log means the report would count too few turns.
                sys.exit(f"bench_node_report: {path} is missing: the turn log of {container}")
            for line in path.read_text().splitlines():
                record = json.loads(line)
                classes[record["class"]] = classes.get(record["class"], 0) + 1
                superseded_turns += record.get("superseded_by") is not None
    failed = int((d / "failed-replays").read_text())
    rate = final["bucket"]["rate_bytes_per_s"] / MIB
    allowed = rate + final["bucket"]["burst_bytes"] / MIB
    return dict(turns=turns, errors=errors, failed=failed, p50=pct(latency, 0.5), p99=pct(latency, 0.99),
                delay_p99=pct(delay, 0.99), delay_max=max(delay, default=0.0), ckpt=ckpt_bytes / MIB,
                store=grown / MIB, disk=disk / MIB, store_peak=peak_1s(samples, 1) / MIB,
                disk_peak=peak_1s(samples, 2) / MIB if own_device else float("nan"),
                mean=grown / MIB / span if span else 0.0, span=span, rate=rate, allowed=allowed,
                lag_max=max(lag.values(), default=0.0), lag_median=statistics.median(lag.values()) if lag else 0.0,
                superseded_turns=superseded_turns, superseded_draws=superseded_draws,
                fs=classes.get("fs", 0), proc=classes.get("proc", 0), paired=paired)


def mib(x):
    return "-" if x != x else f"{x:.2f}"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=pathlib.Path, help="the bench's output directory")
    parser.add_argument("sizes", help='sandbox counts, e.g. "16 32"')
    parser.add_argument("think_scale", type=float)
    parser.add_argument("rate_mib", type=float, help="the bucket variant's rate")
    parser.add_argument("burst_mib", type=float, help="the bucket variant's burst")
    parser.add_argument("state_dir", type=pathlib.Path, help="the store the run used")
    parser.add_argument("heavy_rate_kib", help="the heavy variant's rate (empty: not given)")
    parser.add_argument("heavy_burst_kib", help="the heavy variant's burst (empty: not given)")
    parser.add_argument("variants", help='the variants run, e.g. "unlimited bucket heavy"')
    parser.add_argument("--namespace", default="crab", help="the containerd namespace the sandboxes ran in")
    a = parser.parse_args()
    out, sizes, scale = a.out, a.sizes.split(), a.think_scale
    rate_mib, burst_mib = a.rate_mib, a.burst_mib
    state_dir = a.state_dir
    heavy_rate_kib, heavy_burst_kib = float(a.heavy_rate_kib or "nan"), float(a.heavy_burst_kib or "nan")
    # The store the run used (the config may have moved it since).
    if (out / "state-dir").exists():
        state_dir = pathlib.Path((out / "state-dir").read_text().strip())
    # Turn logs are kept per containerd namespace (turns/<namespace>/<id>.jsonl).
    turns_dir = state_dir / "turns" / a.namespace
    variants = a.variants.split()

    cols = ["sandboxes", "variant", "turns", "fs/proc", "p50_ms", "p99_ms", "p99_infl", "paired_infl", "delay_p99_ms",
            "ckpt_MiB", "store_MiB", "disk_MiB", "store_pk/s", "disk_pk/s", "allowed/s", "mean_MiB/s", "bucket/s",
            "lag_max_ms", "lag_med_ms", "supersede", "run_s", "failed"]
    print(" ".join(f"{c:>11}" for c in cols))
    for size in sizes:
        rows = {v: load(out, size, v, scale, turns_dir) for v in variants if (out / f"{size}-{v}").is_dir()}
        if "unlimited" not in rows:
            continue
        # The same turn's exec time from the unlimited run plus each run's own wait
        # for the previous checkpoint: what the bucket adds, without the exec noise.
        base = rows["unlimited"]["paired"]
        paired_p99 = {}
        for v, r in rows.items():
            common = [k for k in base if k in r["paired"]]
            paired_p99[v] = pct([base[k][0] + r["paired"][k][1] for k in common], 0.99)
        for v, r in rows.items():
            infl = f"{(r['p99'] / rows['unlimited']['p99'] - 1) * 100:+.1f}%" if v != "unlimited" else "-"
            paired_infl = f"{(paired_p99[v] / paired_p99['unlimited'] - 1) * 100:+.2f}%" if v != "unlimited" else "-"
            limited = r["rate"] < 1e6
            cells = [size, v, r["turns"], f"{r['fs']}/{r['proc']}", f"{r['p50']*1e3:.0f}", f"{r['p99']*1e3:.0f}", infl, paired_infl,
                     f"{r['delay_p99']*1e3:.0f}", f"{r['ckpt']:.1f}", f"{r['store']:.1f}", mib(r["disk"]), mib(r["store_peak"]),
                     mib(r["disk_peak"]), mib(r["allowed"]) if limited else "-", f"{r['mean']:.3f}",
                     mib(r["rate"]) if limited else "unlimited", f"{r['lag_max']:.0f}", f"{r['lag_median']:.0f}",
                     f"{r['superseded_turns']}/{r['superseded_draws']}", f"{r['span']:.0f}", f"{r['failed']}+{r['errors']}"]
            print(" ".join(f"{str(c):>11}" for c in cells))
    print(f"bucket: {rate_mib:g} MiB/s, burst {burst_mib:g} MiB; heavy: {heavy_rate_kib:g} KiB/s, burst {heavy_burst_kib:g} KiB; think times x{scale:g}")
    print("failed = failed replays + turns whose checkpoint failed; fs/proc: turns by class (proc = CRIU dump)")
    print("p99_infl: measured turn latencies (exec noise of a shared 2-core host included); paired_infl: each turn's exec time")
    print("from the unlimited run plus each run's own checkpoint wait")
    print("store_pk/s, disk_pk/s: largest growth of the store (distinct files) and of the bytes written to its device over any")
    print("window of >= 1 s, per second; allowed/s: burst + rate x 1 s; '-' for disk: the state dir's device is not its own")
    print("supersede: turns whose process checkpoint was superseded (turn records) / draws crabd answered 'superseded'")


if __name__ == "__main__":
    main()
