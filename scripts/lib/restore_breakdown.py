#!/usr/bin/env python3
"""Where a crab restore's time went (scripts/bench-checkpoint, part 3).

Reads the shim's lines in containerd's debug log (UTC timestamps, comparable with the
bench's `date +%s%N`): the five steps of a restore each log a line with a `restore_step`
field (received, prepared, store, restored, attached) and the figures of that step as
fields (runtime_restore_ms, rootfs_ms, images_ms, ...). Prints one indented table; exits
non-zero naming the steps it found when a step is missing.

Usage: restore_breakdown.py LOG CONTAINER T0_NS T1_NS
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import shim_log  # noqa: E402

STEPS = ("received", "prepared", "store", "restored", "attached")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("log", help="containerd's log (the private containerd's, at debug level)")
    parser.add_argument("container", help="the restored container's id")
    parser.add_argument("t0", type=int, help="ns since the epoch: just before `ctr run`")
    parser.add_argument("t1", type=int, help="ns since the epoch: just after `ctr run` returned")
    args = parser.parse_args()
    t0, t1 = args.t0, args.t1

    marks = {}
    for line in shim_log.lines(args.log):
        # The engine attaches behind the reply: up to 10 s after t1.
        if line.ns < t0 or line.ns > t1 + 10**10 or not line.is_container(args.container):
            continue
        step = line.fields.get("restore_step")
        if step in STEPS and step not in marks:
            marks[step] = line
    if len(marks) < len(STEPS):
        sys.exit(f"found only {sorted(marks)}")

    def ms(a, b):
        return (b - a) / 1e6

    rec, prep, store, rest, att = (marks[k] for k in STEPS)
    runc = rest.number("runtime_restore_ms")
    kept = "linked from the kept copy" if store.number("chunks_read") == 0 and store.number("chunks") > 0 else "from chunks"
    rows = [
        ("ctr + containerd create + shim start, until the shim's Create", ms(t0, rec.ns)),
        ("shim Create: rootfs mount, then:", ms(rec.ns, prep.ns)),
        (f"    rootfs as at the turn (fs deltas)           {store.number('rootfs_ms'):8.1f} ms", None),
        (f"    CRIU images, {kept:<25}    {store.number('images_ms'):8.1f} ms"
         f"  ({int(store.number('image_bytes'))} B, {int(store.number('chunks'))} chunks sha256-checked, {int(store.number('chunks_read'))} chunk blobs read)", None),
        (f"    fork head                                   {store.number('fork_ms'):8.1f} ms", None),
        ("rest of Create, ctr's Start until runc restore begins", ms(prep.ns, rest.ns) - runc),
        ("runc restore (CRIU) inside the shim", runc),
        ("after it: Start reply, ctr exits", ms(rest.ns, t1)),
        (f"engine (crabd, or inspector load without it) attached behind the reply, {ms(t0, att.ns):.1f} ms after t0;", None),
        ("    the first exec waits for it (not in the figure above)", None),
    ]
    for label, value in rows:
        print(f"    {label:<62}" + (f"{value:8.1f} ms" if value is not None else ""))


if __name__ == "__main__":
    main()
