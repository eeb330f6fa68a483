#!/usr/bin/env python3
"""Where a turn's process dump went (scripts/bench-checkpoint, part 6).

Each SAMPLE directory holds what the bench kept of one turn's process checkpoint:
  sample        `<container> <t0 ns> <t1 ns>`: the sandbox, and a window around the turn
  record.json   the turn's record (capture_ms, and dump_ms: the part the dump took)
  dump.log      CRIU's log of the dump
  stats-dump    CRIU's stats image of the dump
                (both from CRIU's work directory: at debug level the runtime keeps the last
                dump's as <runtime root>/<id>.criu-checkpoint-last.{dump.log,stats-dump})
and containerd's debug log holds the shim's `dump_step="runtime"` line of the dump (the
runtime lock, the dump hooks, the runtime's wall). CRIU's stats image is a magic or two,
a 4-byte little-endian size and one protobuf message (stats_entry, field 1 the
dump_stats_entry of images/stats.proto, times in microseconds); it is decoded here, as
neither crit nor pycriu is installed. CRIU's log gives its total (the last line's
timestamp) and phases between the first lines of known steps.

Prints one table of per-step medians over the samples (ms); exits non-zero naming what
is missing from a sample.

Usage: dump_breakdown.py CONTAINERD_LOG SAMPLE...
"""

import argparse
import json
import os
import re
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import shim_log  # noqa: E402

STATS_MAGIC = 0x57093306
# dump_stats_entry (images/stats.proto): field number -> name.
DUMP_STATS = {
    1: "freezing_time", 2: "frozen_time", 3: "memdump_time", 4: "memwrite_time",
    5: "pages_scanned", 6: "pages_skipped_parent", 7: "pages_written", 8: "irmap_resolve",
    9: "pages_lazy", 10: "page_pipes", 11: "page_pipe_bufs",
    12: "shpages_scanned", 13: "shpages_skipped_parent", 14: "shpages_written",
}
# Phases of CRIU's dump log, each from the first line holding its mark (criu/cr-dump.c's
# cr_dump_tasks order) to the next one's; None: the log's last line.
PHASES = (
    ("start: options, kernel probe (kerndat)", None),
    ("setup, freeze, tree and namespaces collected", "Dumping processes (pid:"),
    ("tasks: parasite, registers, memory, files", "Dumping task (pid:"),
    ("mounts, pstree, namespaces, cgroups", "Dumping mountpoints"),
    ("unfreeze, stats, done", "Unfreezing tasks into"),
)
_TS = re.compile(r"^\((\d+)\.(\d+)\)")


def _varint(data, at):
    value = shift = 0
    while True:
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, at


def _fields(data):
    """The varint and length-delimited fields of one protobuf message: {number: value}."""
    out, at = {}, 0
    while at < len(data):
        key, at = _varint(data, at)
        wire, number = key & 7, key >> 3
        if wire == 0:
            out[number], at = _varint(data, at)
        elif wire == 2:
            size, at = _varint(data, at)
            out[number], at = data[at:at + size], at + size
        elif wire == 1:
            at += 8
        elif wire == 5:
            at += 4
        else:
            raise ValueError(f"protobuf wire type {wire} at byte {at}")
    return out


def dump_stats(data):
    """CRIU's stats-dump image as {name: value} (times in microseconds)."""
    # A service image: the common magic, then the stats magic (older CRIUs wrote the latter alone).
    for offset in (4, 0):
        if len(data) >= offset + 8 and int.from_bytes(data[offset:offset + 4], "little") == STATS_MAGIC:
            size = int.from_bytes(data[offset + 4:offset + 8], "little")
            entry = _fields(data[offset + 8:offset + 8 + size])
            break
    else:
        raise ValueError("no stats magic: not a CRIU stats image")
    if 1 not in entry:
        raise ValueError("a stats image without dump stats (a restore's?)")
    return {DUMP_STATS[n]: v for n, v in _fields(entry[1]).items() if n in DUMP_STATS}


def _stamped(text):
    """(ms since CRIU started, line) of each timestamped line of a CRIU log."""
    out = []
    for line in text.splitlines():
        m = _TS.match(line)
        if m:
            out.append((int(m[1]) * 1e3 + int(m[2].ljust(6, "0")[:6]) / 1e3, line))
    return out


def largest_gaps(text, n):
    """The n longest silences of a CRIU log, longest first: (ms, line before, line after).
    CRIU logs before and after each step, so a silence is a step that took that long."""
    stamps = _stamped(text)
    gaps = [(b[0] - a[0], a[1], b[1]) for a, b in zip(stamps, stamps[1:])]
    return sorted(gaps, key=lambda g: -g[0])[:n]


def criu_phases(text):
    """CRIU's total and its phases (ms) from a dump log, and whether it probed the kernel
    (no kerndat cache: CRIU keeps one only on a tmpfs /run)."""
    stamps = _stamped(text)
    if not stamps:
        raise ValueError("no timestamped line: not a CRIU log")
    total = stamps[-1][0]
    if not any(PHASES[1][1] in line for _, line in stamps):
        raise ValueError(f"no line with {PHASES[1][1]!r}: not a dump's log")
    # A step the dump did not take (no mount namespace of its own) takes no time: its
    # start is the next step's.
    starts = [total]
    for _, mark in reversed(PHASES[1:]):
        at = next((ms for ms, line in stamps if mark in line), starts[0])
        starts.insert(0, min(at, starts[0]))
    starts.insert(0, 0.0)
    phases = {label: starts[i + 1] - starts[i] for i, (label, _) in enumerate(PHASES)}
    probed = not any("Loaded kdat cache" in line for _, line in stamps)
    return total, phases, probed


def sample(directory, runtime_lines):
    """One sample's figures (ms, pages): {row name: value}."""
    def path(name):
        p = os.path.join(directory, name)
        if not os.path.exists(p):
            sys.exit(f"{directory}: no {name}")
        return p

    with open(path("sample")) as f:
        container, t0, t1 = f.read().split()
    with open(path("record.json")) as f:
        record = json.load(f)
    if record.get("dump_ms") is None:
        sys.exit(f"{directory}: the turn record has no dump_ms (a shim from before it, or no dump)")
    with open(path("dump.log"), errors="replace") as f:
        try:
            total, phases, probed = criu_phases(f.read())
        except ValueError as e:
            sys.exit(f"{directory}/dump.log: {e}")
    with open(path("stats-dump"), "rb") as f:
        try:
            stats = dump_stats(f.read())
        except ValueError as e:
            sys.exit(f"{directory}/stats-dump: {e}")
    line = next((ln for ln in runtime_lines if ln.is_container(container) and int(t0) <= ln.ns <= int(t1)), None)
    if line is None:
        sys.exit(f"{directory}: no dump_step=runtime line of {container} in containerd's log "
                 "(it must log at debug level: CRAB_CTRD_LOG_LEVEL=debug scripts/containerd start)")
    runtime = line.number("runtime_ms")
    fig = {
        "capture": record["capture_ms"],
        "dump": record["dump_ms"],
        "lock": line.number("lock_ms"),
        "hooks_before": line.number("hooks_before_ms"),
        "runtime": runtime,
        "runc_own": runtime - total,
        "criu": total,
        "freezing": stats.get("freezing_time", 0) / 1e3,
        "frozen": stats.get("frozen_time", 0) / 1e3,
        "memdump": stats.get("memdump_time", 0) / 1e3,
        "memwrite": stats.get("memwrite_time", 0) / 1e3,
        "pages_scanned": stats.get("pages_scanned", 0),
        "pages_written": stats.get("pages_written", 0),
        "pages_skipped_parent": stats.get("pages_skipped_parent", 0),
        "hooks_after": line.number("hooks_after_ms"),
        "staging": record["capture_ms"] - record["dump_ms"],
        "probed": 1 if probed else 0,
    }
    fig["dump_rest"] = fig["dump"] - fig["lock"] - fig["hooks_before"] - runtime - fig["hooks_after"]
    # Each hook's share (shims from before the field have none): "Name=ms,Name=ms".
    for part in filter(None, line.fields.get("each_hook_before", "").split(",")):
        name, _, ms = part.partition("=")
        fig["hook:" + name] = float(ms)
    for label, ms in phases.items():
        fig["phase:" + label] = ms
    fig["log"] = os.path.join(directory, "dump.log")
    return fig


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("log", help="containerd's log (the private containerd's, at debug level)")
    parser.add_argument("samples", nargs="+", help="directories the bench kept, one per dump")
    args = parser.parse_args()
    runtime_lines = [ln for ln in shim_log.lines(args.log) if ln.fields.get("dump_step") == "runtime"]
    figs = [sample(d, runtime_lines) for d in args.samples]

    def med(key):
        return statistics.median(f[key] for f in figs)

    def row(label, key, indent=0, extra=""):
        print(f"    {'  ' * indent + label:<66}{med(key):8.1f} ms{extra}")

    print(f"    medians over {len(figs)} dumps (each row its own median: rows need not add up exactly)")
    row("capture (turn record capture_ms: the next turn waits for it)", "capture")
    row("process dump (turn record dump_ms)", "dump", 1)
    row("shim: waiting for the runtime's lock", "lock", 2)
    row("shim: hooks before (spawner detach, network-lock choice, next pid)", "hooks_before", 2)
    for key in sorted({k for f in figs for k in f if k.startswith("hook:")}):
        if all(key in f for f in figs):
            row(key[len("hook:"):], key, 3)
    row("runc checkpoint (wall)", "runtime", 2)
    row("runc's own (its wall minus CRIU's log)", "runc_own", 3)
    probed = sum(f["probed"] for f in figs)
    row("CRIU (its log's last timestamp)", "criu", 3)
    for label, _ in PHASES:
        note = ""
        if label.startswith("start"):
            note = f"  (no kerndat cache in {probed}/{len(figs)} dumps)" if probed else "  (kerndat cache loaded)"
        row(label, "phase:" + label, 4, note)
    row("freezing (stats-dump freezing_time)", "freezing", 4)
    row("frozen (stats-dump frozen_time)", "frozen", 4)
    pages = f"  ({med('pages_scanned'):.0f} pages scanned, {med('pages_written'):.0f} written, " \
            f"{med('pages_skipped_parent'):.0f} from a parent)"
    row("memory dump (stats-dump memdump_time)", "memdump", 5, pages)
    row("memory write (stats-dump memwrite_time)", "memwrite", 5)
    row("shim: hooks after (crab-init digest and key into the images)", "hooks_after", 2)
    row("rest (directories, CRIU env, retries)", "dump_rest", 2)
    row("staging into the store (capture_ms minus dump_ms)", "staging", 1)
    # Where CRIU itself was slow: the longest silences of the median dump's log.
    median = sorted(figs, key=lambda f: f["criu"])[(len(figs) - 1) // 2]
    with open(median["log"], errors="replace") as f:
        gaps = largest_gaps(f.read(), 8)
    print(f"    the longest steps of the median dump's CRIU log ({median['criu']:.1f} ms), each after the first line:")
    for ms, before, after in gaps:
        print(f"    {ms:8.1f} ms  {before.strip()[:80]}")
        print(f"    {'':8}  -> {after.strip()[:80]}")


if __name__ == "__main__":
    main()
