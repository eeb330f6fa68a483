#!/usr/bin/env python3
"""The table of scripts/bench-shim: run->exit and exec latency (median and mean) and shim
RSS of each variant, with each one's ratio to runc's shim, and crab over crun's to crab
over runc when both ran.

Usage: bench_shim_report.py --rounds N
         --run VARIANT "NS NS ..." --exec VARIANT "NS NS ..." --rss-kb VARIANT KB  (each per variant)
  VARIANT: runc, crab-off, crab, and optionally crun-off and crun (crab over crun);
  NS: one sample in nanoseconds.
"""

import argparse
import statistics

REQUIRED = ("runc", "crab-off", "crab")
OPTIONAL = ("crun-off", "crun")
# crab over crun against crab over runc, same policy.
OVER_RUNC = {"crun-off": "crab-off", "crun": "crab"}


def per_variant(pairs, option):
    got = dict(pairs or [])
    missing = [v for v in REQUIRED if v not in got]
    if missing:
        raise SystemExit(f"{option}: no samples for {', '.join(missing)}")
    unknown = [v for v in got if v not in REQUIRED + OPTIONAL]
    if unknown:
        raise SystemExit(f"{option}: unknown variant {', '.join(unknown)}")
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
    variants = [v for v in REQUIRED + OPTIONAL if v in run]
    ratios = [(v, "runc") for v in variants if v != "runc"]
    ratios += [(v, OVER_RUNC[v]) for v in variants if v in OVER_RUNC]

    def ms(s):
        return [int(x) / 1e6 for x in s.split()]

    print(f"rounds: {a.rounds} (interleaved); crab-off = crab shim with io.crab.policy=off, crab = checkpointing every turn as classified;"
          " crun-off/crun = the same over crun")
    header = f"{'metric':<20}" + "".join(f"{v:>10}" for v in variants) + "".join(f"{n + '/' + d:>18}" for n, d in ratios)
    print(header)

    def row(name, values):
        cells = "".join(f"{values[v]:>10.1f}" for v in variants)
        cells += "".join(f"{values[n] / values[d]:>18.3f}" for n, d in ratios)
        print(f"{name:<20}{cells}")

    for name, data, f in (("run->exit p50 ms", run, statistics.median), ("run->exit mean ms", run, statistics.mean),
                          ("exec p50 ms", exe, statistics.median), ("exec mean ms", exe, statistics.mean)):
        row(name, {v: f(ms(data[v])) for v in variants})
    row("shim RSS MiB", {v: rss[v] / 1024 for v in variants})


if __name__ == "__main__":
    main()
