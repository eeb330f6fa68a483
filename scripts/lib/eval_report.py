#!/usr/bin/env python3
"""Aggregates the JSON that `crabctl replay --json-out` wrote for each trace of
an evaluation run into report.md, summary.json and SVG plots.

Usage: eval_report.py OUTDIR

Reads OUTDIR/raw/*.json (one list of trace reports per file),
OUTDIR/errors.jsonl (traces whose replay failed: {"trace", "error"}) and
OUTDIR/classes/*.jsonl (the crab shim's turn classes: {"trace", "turn",
"class", "bytes"}). Standard library only, so it runs wherever python3 does.
"""

import json
import math
import sys
from pathlib import Path

POLICY_ORDER = ["off", "chat-only", "every-turn", "crab"]
CLASS_ORDER = ["clean", "fs", "proc"]

# The paper's headline figures, shown beside ours.
PAPER = {
    "correctness": "chat-only 8% -> crab 100%",
    "traffic": "up to 87% less checkpoint traffic than every-turn",
    "run_time": "within 1.9% of fault-free run time",
}


class EvalInputError(Exception):
    pass


def percentile(values, fraction):
    """Nearest-rank percentile: the smallest value with at least `fraction` of
    the values at or below it (no interpolation between samples)."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(fraction * len(ordered)))
    return ordered[rank - 1]


def load_reports(raw_dir):
    reports = []
    for path in sorted(raw_dir.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as error:
            raise EvalInputError(f"{path}: not JSON: {error}") from error
        if not isinstance(data, list):
            raise EvalInputError(f"{path}: expected a list of trace reports")
        reports.extend(data)
    return reports


def load_jsonl(path):
    if not path.exists():
        return []
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as error:
                raise EvalInputError(f"{path}:{number}: not JSON: {error}") from error
    return rows


def load_classes(classes_dir):
    rows = []
    if classes_dir.is_dir():
        for path in sorted(classes_dir.glob("*.jsonl")):
            rows.extend(load_jsonl(path))
    return rows


def reference_time_per_run(report):
    reference = report["reference"]
    runs = max(1, reference["runs"])
    return reference["run_time_s"] / runs


def aggregate(reports, errors, classes):
    """Per-policy totals over all traces. Run-time overhead compares each
    policy's faulted run with one fault-free reference run of the same trace
    (the replay has no separate `off` run without a fault)."""
    policies = {}
    for report in reports:
        baseline_s = reference_time_per_run(report)
        for run in report["runs"]:
            name = run["policy"]
            stats = policies.setdefault(name, {
                "traces": 0, "faulted": 0, "correct": 0,
                "checkpoints": 0, "checkpoint_failures": 0,
                "checkpoint_bytes": 0, "run_time_s": 0.0,
                "baseline_s": 0.0, "delays": [], "first_checkpoint_error": None,
            })
            stats["traces"] += 1
            if run["recovered_correctly"] is not None:
                stats["faulted"] += 1
                stats["correct"] += 1 if run["recovered_correctly"] else 0
            stats["checkpoints"] += run["checkpoints"]
            stats["checkpoint_failures"] += run["checkpoint_failures"]
            stats["checkpoint_bytes"] += run["checkpoint_bytes"]
            stats["run_time_s"] += run["run_time_s"]
            stats["baseline_s"] += baseline_s
            stats["delays"].extend(turn["agent_visible_delay_s"] for turn in run["turns"])
            if stats["first_checkpoint_error"] is None:
                stats["first_checkpoint_error"] = next(
                    (f"{report['trace']} turn {turn['turn']}: {turn['checkpoint_error']}"
                     for turn in run["turns"] if turn.get("checkpoint_error")), None)

    every_turn_bytes = policies.get("every-turn", {}).get("checkpoint_bytes")
    summary = {}
    for name in sorted(policies, key=policy_rank):
        stats = policies[name]
        delays = stats.pop("delays")
        summary[name] = {
            **stats,
            "correct_pct": pct(stats["correct"], stats["faulted"]),
            "bytes_vs_every_turn": (stats["checkpoint_bytes"] / every_turn_bytes
                                    if every_turn_bytes else None),
            "run_time_vs_fault_free": (stats["run_time_s"] / stats["baseline_s"]
                                       if stats["baseline_s"] > 0 else None),
            "delay_p50_s": percentile(delays, 0.50),
            "delay_p99_s": percentile(delays, 0.99),
            "turns": len(delays),
        }

    class_counts = {name: 0 for name in CLASS_ORDER}
    class_bytes = 0
    for row in classes:
        class_counts[row["class"]] = class_counts.get(row["class"], 0) + 1
        class_bytes += row.get("bytes") or 0
    total_classified = sum(class_counts.values())
    return {
        "traces": len(reports),
        "failed_traces": errors,
        "policies": summary,
        "classes": {
            "turns": total_classified,
            "counts": class_counts,
            "pct": {name: pct(count, total_classified) for name, count in class_counts.items()},
            "bytes": class_bytes,
        } if total_classified else None,
    }


def policy_rank(name):
    return POLICY_ORDER.index(name) if name in POLICY_ORDER else len(POLICY_ORDER)


def pct(part, whole):
    return 100.0 * part / whole if whole else None


def human_bytes(count):
    value = float(count)
    for unit in ["B", "KiB", "MiB", "GiB"]:
        if value < 1024 or unit == "GiB":
            return f"{count} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{count} B"


def fmt(value, pattern, missing="-"):
    return missing if value is None else pattern.format(value)


def render_markdown(summary, meta):
    lines = ["# Crab evaluation", ""]
    for key, value in meta.items():
        lines.append(f"- {key}: {value}")
    lines += [f"- traces replayed: {summary['traces']}, failed: {len(summary['failed_traces'])}", ""]
    lines += [
        "## Per policy", "",
        "| policy | recovered correctly | checkpoints (failed) | checkpoint bytes | bytes vs every-turn "
        "| run time vs fault-free | delay p50 / turn | delay p99 / turn |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, stats in summary["policies"].items():
        correct = (f"{stats['correct_pct']:.0f}% ({stats['correct']}/{stats['faulted']})"
                   if stats["faulted"] else "- (no fault)")
        lines.append(
            f"| {name} | {correct} | {stats['checkpoints']} ({stats['checkpoint_failures']}) "
            f"| {human_bytes(stats['checkpoint_bytes'])} "
            f"| {fmt(stats['bytes_vs_every_turn'], '{:.1%}')} "
            f"| {fmt(stats['run_time_vs_fault_free'], '{:.3f}x')} "
            f"| {fmt(stats['delay_p50_s'], '{:.3f} s')} | {fmt(stats['delay_p99_s'], '{:.3f} s')} |"
        )
    lines += [
        "",
        "Run time vs fault-free: the replay has no separate fault-free `off` run, so the baseline is the "
        "reference run's wall time (one run; with `--ref-runs 2` the reference time is halved). The reference "
        "run also fingerprints the sandbox after every turn, so it is slower than a bare run and the ratio "
        "understates the overhead; the faulted runs include the fault, the recovery and the replayed turns.",
        "",
    ]
    failing = [(name, stats) for name, stats in summary["policies"].items() if stats["first_checkpoint_error"]]
    if failing:
        lines += ["Checkpoint failures (they count in the delays and run times above):", ""]
        for name, stats in failing:
            lines.append(f"- {name}: {stats['checkpoint_failures']} failed, first: {stats['first_checkpoint_error']}")
        lines.append("")
    classes = summary["classes"]
    lines += ["## Crab's turn classes", ""]
    if classes:
        lines += ["| class | turns | share |", "|---|---|---|"]
        for name, count in classes["counts"].items():
            lines.append(f"| {name} | {count} | {classes['pct'][name]:.1f}% |")
        lines += ["", f"{classes['turns']} turns, {human_bytes(classes['bytes'])} written by the shim's checkpoints "
                  "(from the shim's turn logs of the crab policy's sandboxes in these replays, recovery included).", ""]
    else:
        lines += ["Not available (no shim turn logs: crab was not among the policies, or --no-classes).", ""]

    policies = summary["policies"]
    lines += ["## Beside the paper", "", "| figure | paper | ours |", "|---|---|---|"]
    chat, crab, every = policies.get("chat-only"), policies.get("crab"), policies.get("every-turn")
    ours_correct = (f"chat-only {fmt(chat and chat['correct_pct'], '{:.0f}%', 'n/a')} -> "
                    f"crab {fmt(crab and crab['correct_pct'], '{:.0f}%', 'n/a')}")
    cut = crab and crab["bytes_vs_every_turn"]
    ours_traffic = f"{(1 - cut):.1%} less than every-turn" if cut is not None else "n/a"
    overhead = crab and crab["run_time_vs_fault_free"]
    ours_time = f"{(overhead - 1):+.1%} vs fault-free reference" if overhead is not None else "n/a"
    lines += [
        f"| recovery correctness | {PAPER['correctness']} | {ours_correct} |",
        f"| checkpoint traffic | {PAPER['traffic']} | {ours_traffic} |",
        f"| run time | {PAPER['run_time']} | {ours_time} |",
        "",
    ]
    if summary["failed_traces"]:
        lines += ["## Failed traces", ""]
        for failure in summary["failed_traces"]:
            lines.append(f"- `{failure['trace']}`: {failure['error']}")
        lines.append("")
    lines += ["## Plots", "", "![bytes](plots/bytes.svg) ![run time](plots/run_time.svg) "
              "![correctness](plots/correctness.svg) ![classes](plots/classes.svg)", ""]
    return "\n".join(lines)


def svg_bars(title, unit, bars):
    """A horizontal bar chart; bars is a list of (label, value or None)."""
    width, left, row, top = 560, 110, 28, 40
    height = top + row * max(1, len(bars)) + 20
    values = [value for _, value in bars if value is not None]
    scale_max = max(values) if values and max(values) > 0 else 1.0
    plot_width = width - left - 120
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'font-family="sans-serif" font-size="13">',
        f'<text x="10" y="22" font-weight="bold">{escape(title)}</text>',
    ]
    for index, (label, value) in enumerate(bars):
        y = top + index * row
        parts.append(f'<text x="{left - 8}" y="{y + 15}" text-anchor="end">{escape(label)}</text>')
        if value is None:
            parts.append(f'<text x="{left + 4}" y="{y + 15}" fill="#888">n/a</text>')
            continue
        length = max(0.0, value) / scale_max * plot_width
        parts.append(f'<rect x="{left}" y="{y + 2}" width="{length:.1f}" height="{row - 8}" fill="#3b78c2"/>')
        parts.append(f'<text x="{left + length + 6:.1f}" y="{y + 15}">{escape(unit(value))}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def escape(text):
    return str(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def write_plots(summary, plots_dir):
    plots_dir.mkdir(parents=True, exist_ok=True)
    policies = summary["policies"]
    plots = {
        "bytes.svg": svg_bars("Checkpoint bytes per policy", human_bytes,
                              [(name, stats["checkpoint_bytes"]) for name, stats in policies.items()]),
        "run_time.svg": svg_bars(
            "Run-time overhead vs fault-free reference", lambda value: f"{value:+.1f}%",
            [(name, None if stats["run_time_vs_fault_free"] is None
              else 100.0 * (stats["run_time_vs_fault_free"] - 1)) for name, stats in policies.items()]),
        "correctness.svg": svg_bars("Recovered correctly", lambda value: f"{value:.0f}%",
                                    [(name, stats["correct_pct"]) for name, stats in policies.items()]),
    }
    classes = summary["classes"]
    plots["classes.svg"] = svg_bars(
        "Crab's turn classes", lambda value: f"{value:.1f}%",
        [(name, classes["pct"][name]) for name in classes["counts"]] if classes else [("no data", None)])
    for name, text in plots.items():
        (plots_dir / name).write_text(text)


def main(argv):
    if len(argv) != 2:
        print("usage: eval_report.py OUTDIR", file=sys.stderr)
        return 2
    out = Path(argv[1])
    try:
        if not (out / "raw").is_dir():
            raise EvalInputError(f"{out / 'raw'}: no such directory (nothing was replayed?)")
        meta_path = out / "meta.json"
        meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
        summary = aggregate(load_reports(out / "raw"), load_jsonl(out / "errors.jsonl"),
                            load_classes(out / "classes"))
    except (EvalInputError, KeyError, TypeError, OSError) as error:
        print(f"eval_report.py: error: {error!r}", file=sys.stderr)
        return 1
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "report.md").write_text(render_markdown(summary, meta))
    write_plots(summary, out / "plots")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
