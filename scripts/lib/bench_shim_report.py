#!/usr/bin/env python3
"""The table of scripts/bench-shim: run->exit and exec latency (median and mean) and shim
RSS of runc, crab-off and crab, with crab-off/runc and crab/runc ratios.

Usage: bench_shim_report.py --rounds N
         --run VARIANT "NS NS ..." --exec VARIANT "NS NS ..." --rss-kb VARIANT KB  (each per variant)
  VARIANT: runc, crab-off or crab; NS: one sample in nanoseconds.
"""

import argparse
import statistics

VARIANTS = ("runc", "crab-off", "crab")


def per_variant(pairs, option):
    got = dict(pairs or [])
    missing = [v for v in VARIANTS if v not in got]
    if missing:
        raise SystemExit(f"{option}: no samples for {', '.join(missing)}")
    return got


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", required=True, help="rounds run (shown in the report)")
    parser.add_argument("--run", nargs=2, action="append", metavar=("VARIANT", "NS_LIST"))
    parser.add_argument("--exec", nargs=2, action="append", metavar=("VARIANT", "NS_LIST"))
    parser.add_argument("--rss-kb", nargs=2, action="append", metavar=("VARIANT", "KB"))
    a = parser.parse_args()
    run, exe = per_variant(a.run, "--run"), per_variant(a.exec, "--exec")
    rss = {k: int(v) for k, v in per_variant(a.rss_kb, "--rss-kb").items()}

    def ms(s):
        return [int(x) / 1e6 for x in s.split()]

    print(f"rounds: {a.rounds} (interleaved); crab-off = crab shim with io.crab.policy=off, crab = checkpointing every turn as classified")
    print(f"{'metric':<20}{'runc':>9}{'crab-off':>10}{'crab':>9}{'off/runc':>10}{'crab/runc':>11}")
    for name, data, f in (("run->exit p50 ms", run, statistics.median), ("run->exit mean ms", run, statistics.mean),
                          ("exec p50 ms", exe, statistics.median), ("exec mean ms", exe, statistics.mean)):
        r, o, c = (f(ms(data[k])) for k in VARIANTS)
        print(f"{name:<20}{r:>9.1f}{o:>10.1f}{c:>9.1f}{o / r:>10.3f}{c / r:>11.3f}")
    r, o, c = (rss[k] / 1024 for k in VARIANTS)
    print(f"{'shim RSS MiB':<20}{r:>9.1f}{o:>10.1f}{c:>9.1f}{o / r:>10.3f}{c / r:>11.3f}")


if __name__ == "__main__":
    main()
