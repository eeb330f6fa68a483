#!/usr/bin/env python3
"""The report of scripts/bench-checkpoint: its figures, each beside its goal.

  1. agent-visible delay per turn by class: for each sandbox of part 1, the wait of each
     exec for the previous turn's checkpoint (the shim's `waited_us` field in containerd's
     debug log, by `container` and `exec`), grouped by the class of the turn before it (the
     sandbox's turn log), and the bytes each policy wrote
  2. and 4. the lines of the store bench (`cargo bench --bench checkpoint_store`)
  3. full restore: the medians the bench measured, passed as arguments, and the breakdown
     of the median crab sample (WORK/breakdown, from restore_breakdown.py)

Usage: bench_checkpoint_report.py --state DIR --work DIR --namespace NS --containerd-log LOG
         [--store-bench FILE] [--crab-restore-ns N ...] [DELAY_SANDBOX ...]
"""

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import shim_log  # noqa: E402


def pct(values, p):
    values = sorted(values)
    return values[min(len(values) - 1, round((len(values) - 1) * p))]


def turn_waits(log, ids):
    """Per sandbox, exec id -> how long (us) its turn start waited for the previous capture."""
    waits = {id: {} for id in ids}
    if not ids:
        return waits
    for line in shim_log.lines(log):
        if "waited_us" not in line.fields or "exec" not in line.fields:
            continue
        for id in ids:
            if line.is_container(id):
                waits[id][line.fields["exec"]] = line.fields["waited_us"]
    return waits


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--state", required=True, help="the bench's crab state directory (turn logs)")
    parser.add_argument("--work", required=True, help="the bench's work directory (breakdown, breakdown-sample)")
    parser.add_argument("--namespace", required=True, help="the containerd namespace of the sandboxes")
    parser.add_argument("--containerd-log", required=True, help="containerd's log, at debug level")
    parser.add_argument("--store-bench", help="a file holding the store bench's output")
    for name in ("crab-restore-ns", "runc-restore-ns", "runc-dump-ns", "proc-bytes", "ctrd-restore-ns",
                 "ctrd-dump-ns", "first-exec-ns"):
        parser.add_argument(f"--{name}", type=int, default=0)
    parser.add_argument("--no-crabd", action="store_true", help="part 3 ran without a crabd")
    parser.add_argument("--crab-samples", default="", help="part 3's crab samples, ns, space-separated")
    parser.add_argument("--runc-samples", default="", help="part 3's runc samples, ns, space-separated")
    parser.add_argument("--crun-samples", help="part 5's file: lines of runtime, capture ms, restore ns")
    parser.add_argument("--dump-breakdown", help="part 6's table (dump_breakdown.py's output)")
    parser.add_argument("--dump-rounds", type=int, default=0, help="part 6's number of dumps")
    parser.add_argument("ids", nargs="*", help="part 1's sandboxes: bench-delay-<policy>-<pid>")
    a = parser.parse_args()
    store_bench = ""
    if a.store_bench and os.path.exists(a.store_bench):
        with open(a.store_bench) as f:
            store_bench = f.read()
    state, work, ids = a.state, a.work, a.ids

    if ids: print("== 1. agent-visible delay per turn at zero think time (the wait of the next exec, by the class of the turn before it)")
    total = {}
    all_waits = turn_waits(a.containerd_log, ids)
    for id in ids:
        policy = id.split("-")[2] if "every" not in id else "every-turn"
        with open(f"{state}/turns/{a.namespace}/{id}.jsonl") as f:
            records = {r["turn"]: r for r in map(json.loads, f)}
        waits = all_waits[id]
        by_class, job_by_class = {}, {}
        for turn, rec in records.items():
            wait = waits.get(f"t{turn + 1}")
            if wait is not None:
                by_class.setdefault(rec["class"], []).append(int(wait) / 1000)
                job_by_class.setdefault(rec["class"], []).append(rec["checkpoint_ms"])
        for cls in ("fs", "clean", "proc"):
            ms, job = by_class.get(cls, []), job_by_class.get(cls, [])
            if ms:
                goal = "   goal p50 <= 1 ms, p99 <= 10 ms" if cls == "fs" and policy == "crab" else ""
                print(f"  {policy:<11}{cls:<6} n={len(ms):<3} p50={pct(ms, .5):8.3f} ms  p99={pct(ms, .99):8.3f} ms  max={max(ms):8.3f} ms{goal}")
                print(f"  {'':<17}whole checkpoint job (capture + write-out): p50={pct(job, .5):8.3f} ms  p99={pct(job, .99):8.3f} ms")
        failed = [r["turn"] for r in records.values() if any("checkpoint failed" in x for x in r["reasons"])]
        if failed:
            print(f"  {policy}: checkpoints failed at turns {failed}")
        total[policy] = {"all": sum(r["bytes_written"] for r in records.values()), "turns": len(records)}
    if ids:
        print("  bytes written over the same turns:")
        c, e = total["crab"]["all"], total["every-turn"]["all"]
        print(f"    crab={c} B over {total['crab']['turns']} turns, every-turn={e} B over {total['every-turn']['turns']} turns, "
              f"crab/every-turn={c / e:.4f}   goal <= 0.10 (on the dev traces; these turns are synthetic)")

    if "rollback" in store_bench: print("== 2. in-place rollback of fs turns (store bench)")
    for line in store_bench.splitlines():
        if line.startswith("rollback in place"):
            goal = "   goal p50 <= 1.5 ms" if " 10 changed" in line else "   goal p50 <= 20 ms"
            print("  " + line + goal)

    crab_ms, runc_ms = a.crab_restore_ns / 1e6, a.runc_restore_ns / 1e6
    n_samples = len(a.crab_samples.split())
    no_crabd = "no crabd" if a.no_crabd else ""
    if runc_ms: print(f"== 3. full restore of a process holding 64 MiB (median of {n_samples} alternating samples each; {no_crabd or 'with crabd'})")
    if runc_ms: print(f"  crab (ctr run with io.crab.restore-from: containerd, rootfs, images from chunks, runc restore): {crab_ms:9.1f} ms")
    if runc_ms: print(f"  runc restore -d from a plain image dir, the same images (crab's dump took {a.runc_dump_ns / 1e6:.1f} ms):  {runc_ms:9.1f} ms")
    if runc_ms: print(f"  crab/runc = {crab_ms / runc_ms:.3f}   goal <= 1.2   (crab's process checkpoint wrote {a.proc_bytes} B)")
    if runc_ms: print(f"  from ctr run to the end of a first exec in the restored sandbox (ps):                             {a.first_exec_ns / 1e6:9.1f} ms")
    if runc_ms: print("  samples crab: " + " ".join(f"{int(x) / 1e6:.0f}" for x in a.crab_samples.split()) + " ms; runc: " + " ".join(f"{int(x) / 1e6:.0f}" for x in a.runc_samples.split()) + " ms")
    if runc_ms and os.path.exists(f"{work}/breakdown"):
        which = open(f"{work}/breakdown-sample").read().strip() if os.path.exists(f"{work}/breakdown-sample") else "?"
        print(f"  where crab's time went (the median sample, #{which}, from the shim's debug log):")
        print(open(f"{work}/breakdown").read(), end="")
    ctrd_ms = a.ctrd_restore_ns / 1e6
    if runc_ms and ctrd_ms:
        print(f"  containerd's own ctr c restore --live via io.containerd.runc.v2 (ctr c checkpoint --task took {a.ctrd_dump_ns / 1e6:.1f} ms): {ctrd_ms:9.1f} ms")
        print(f"  crab/ctr-c-restore = {crab_ms / ctrd_ms:.3f}   (what containerd users have today; no goal)")
        print("  fairness: the runc figure is runc restore alone, from an image dir already in place, into a bundle")
        print("  whose rootfs is already mounted: no containerd, no shim, no rootfs, no integrity check. crab's figure")
        print("  includes all of those and verifies every blob; the goal line is still crab versus runc alone.")

    if "CRIU dump" in store_bench: print("== 4. second full CRIU dump of an unchanged process (store bench)")
    for line in store_bench.splitlines():
        if line.startswith("CRIU dump turn"):
            goal = "   goal ratio <= 0.05" if "turn 2" in line else ""
            print("  " + line + goal)

    crun_report(a.crun_samples)
    if a.dump_breakdown:
        print(f"== 6. where a small sandbox's process dump goes (busybox with a shell loop; {a.dump_rounds} turns, each a dump)")
        print(open(a.dump_breakdown).read(), end="")


def crun_report(path):
    """Part 5: medians per runtime of a process turn's capture and of its restore, and crun/runc."""
    try:
        rows = [line.split() for line in open(path) if line.strip()]
    except (FileNotFoundError, TypeError):
        return
    by = {"runc": ([], []), "crun": ([], [])}
    for runtime, capture_ms, restore_ns in rows:
        by[runtime][0].append(float(capture_ms))
        by[runtime][1].append(int(restore_ns) / 1e6)
    n = min(len(by["runc"][0]), len(by["crun"][0]))
    if n == 0:
        return
    print(f"== 5. crab over crun beside crab over runc (a shell holding 32 MiB; median of {n} alternating sandboxes each)")
    print(f"  {'':<52}{'runc':>9}{'crun':>9}{'crun/runc':>11}")
    for i, name in ((0, "process turn's capture (CRIU dump and staging), ms"), (1, "restore of that turn (ctr run, restore-from), ms")):
        r, c = statistics.median(by["runc"][i]), statistics.median(by["crun"][i])
        print(f"  {name:<52}{r:>9.1f}{c:>9.1f}{c / r:>11.3f}")


if __name__ == "__main__":
    main()
