#!/usr/bin/env python3
"""The table of scripts/bench-builds: p50 and p90 of each figure per build, the ratio of each
build's p50 to the first build's, and the median of the per-round ratios (each build against
the first in the same round, the rounds being interleaved).

Usage: bench_builds_report.py --samples FILE --rounds N --build NAME DESCRIPTION ...
  FILE: lines "FIGURE BUILD VALUE ROUND"; a FIGURE starting with fail- counts one failure.
  The first --build is the base of the ratios.
"""

import argparse
import statistics
from collections import defaultdict

# Figures in the order printed, with their unit; any other figure follows in the order met.
FIGURES = [
    ("run-off", "ms"), ("run-crab", "ms"),
    ("start-off", "ms"), ("start-crab", "ms"),
    ("exec-off", "ms"), ("exec-crab", "ms"),
    ("exec-fs-turn", "ms"), ("exec-proc-turn", "ms"), ("exec-after-proc", "ms"),
    ("fs-checkpoint-ms", "ms"), ("fs-capture-ms", "ms"), ("fs-bytes", "B"),
    ("proc-checkpoint-ms", "ms"), ("proc-capture-ms", "ms"), ("proc-bytes", "B"),
    ("restore", "ms"), ("restore-first-exec", "ms"),
    ("rss-off-kb", "KiB"), ("rss-crab-kb", "KiB"), ("anon-off-kb", "KiB"), ("anon-crab-kb", "KiB"),
]


def percentile(xs, p):
    """Linear interpolation between the closest ranks."""
    xs = sorted(xs)
    k = (len(xs) - 1) * p
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def read_samples(path):
    values = defaultdict(lambda: defaultdict(list))  # figure -> build -> [value]
    by_round = defaultdict(lambda: defaultdict(dict))  # figure -> build -> round -> [value]
    failures = defaultdict(lambda: defaultdict(int))  # build -> figure -> count
    order = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            parts = line.split()
            if len(parts) != 4:
                raise SystemExit(f"{path}:{n}: not 'FIGURE BUILD VALUE ROUND': {line!r}")
            figure, build, value, rnd = parts
            if figure.startswith("fail-"):
                failures[build][figure[len("fail-"):]] += 1
                continue
            x = float(value)
            if figure not in order:
                order.append(figure)
            values[figure][build].append(x)
            by_round[figure][build].setdefault(rnd, []).append(x)
    return values, by_round, failures, order


def number(x, unit):
    if unit == "B":
        return f"{x:.0f}"
    if unit == "KiB":
        return f"{x:.0f}"
    return f"{x:.2f}" if x < 100 else f"{x:.1f}"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", required=True)
    parser.add_argument("--rounds", required=True)
    parser.add_argument("--build", nargs=2, action="append", required=True, metavar=("NAME", "DESCRIPTION"))
    a = parser.parse_args()
    builds = [name for name, _ in a.build]
    base, others = builds[0], builds[1:]
    values, by_round, failures, order = read_samples(a.samples)

    print(f"rounds: {a.rounds}, interleaved (order reversed every other round); only ratios within this run count")
    for name, description in a.build:
        print(f"  {name:<16} {description}")
    print("off = io.crab.policy=off, crab = io.crab.policy=crab; p50/p90 over all samples of the run;"
          f" x/{base} = ratio of p50s, paired = median of the per-round ratios")

    units = dict(FIGURES)
    figures = [f for f, _ in FIGURES if f in values] + [f for f in order if f not in units]
    width = max([len(f"{f} ({units.get(f, '')})") for f in figures] + [10])
    header = f"{'figure':<{width}}"
    for b in builds:
        header += f"{b + ' p50':>13}{b + ' p90':>13}"
    for o in others:
        header += f"{o + '/' + base:>14}{'paired':>8}"
    header += "  n"
    print(header)
    for f in figures:
        unit = units.get(f, "")
        row = f"{f + ' (' + unit + ')' if unit else f:<{width}}"
        for b in builds:
            xs = values[f].get(b)
            row += f"{number(percentile(xs, .5), unit):>13}{number(percentile(xs, .9), unit):>13}" if xs else f"{'-':>13}{'-':>13}"
        for o in others:
            bx, ox = values[f].get(base), values[f].get(o)
            if bx and ox and percentile(bx, .5) > 0:
                paired = [statistics.median(ox_r) / statistics.median(by_round[f][base][r])
                          for r, ox_r in by_round[f][o].items()
                          if r in by_round[f][base] and statistics.median(by_round[f][base][r]) > 0]
                row += f"{percentile(ox, .5) / percentile(bx, .5):>14.3f}"
                row += f"{statistics.median(paired):>8.3f}" if paired else f"{'-':>8}"
            else:
                row += f"{'-':>14}{'-':>8}"
        row += "  " + "/".join(str(len(values[f].get(b, []))) for b in builds)
        print(row)
    failed = False
    for b in builds:
        if failures.get(b):
            failed = True
            print(f"failures of {b}: " + ", ".join(f"{f} {n}" for f, n in sorted(failures[b].items())))
    if not failed:
        print("failures: none")


if __name__ == "__main__":
    main()
