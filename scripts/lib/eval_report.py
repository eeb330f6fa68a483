#!/usr/bin/env python3
"""Aggregates the JSON that `crab-replay --json-out` wrote for each trace of
an evaluation run into report.md, summary.json and SVG plots.

Usage: eval_report.py OUTDIR

Reads OUTDIR/raw/**/*.json (one list of trace reports per file: one report per
trace and fault kind), OUTDIR/errors.jsonl (traces whose replay failed:
{"trace", "error"}), OUTDIR/classes/*.jsonl (the crab shim's turn classes:
{"trace", "turn", "class", "bytes"}) and OUTDIR/meta.json or OUTDIR/meta/*.json
(what each batch ran; a batch whose meta has "replaces": "B1,B2" is a rerun,
and its reports replace those batches' reports of the same trace and fault).
Standard library only, so it runs wherever python3 does.

Figures:
- recovery correctness per policy and fault kind (reports with a fault);
- checkpoint bytes per policy and their ratio to every-turn over the same
  (trace, fault) reports;
- run time per policy against `off` in the same report, per think-time scale
  (the fault-free reports are the measure; faulted ones include recovery);
- agent-visible delay per turn (what the agent waited beyond its think time);
- crab's turn class distribution;
- what the oracle compared, excluded and matched only after normalising
  wall-clock stamps or stderr line order, and where incorrect runs differed.
"""

import json
import math
import sys
from pathlib import Path

POLICY_ORDER = ["off", "chat-only", "every-turn", "crab"]
FAULT_ORDER = ["kill-processes", "kill-shim", "restart-containerd", "kill-crabd", "containerd-state-loss", "node-loss"]
# Faults that destroy the sandbox's state: the headline correctness is computed over these.
STATE_DESTROYING = ["kill-processes", "kill-shim", "containerd-state-loss", "node-loss"]
# Faults that leave the sandbox running (every policy, `off` included, keeps its state): shown
# apart, as checks that the sandbox stays available and checkpointed through them.
AVAILABILITY = ["restart-containerd", "kill-crabd"]
CLASS_ORDER = ["clean", "fs", "proc"]
# Faults with nothing to strike in some policies' sandboxes: crab-replay makes no run of those
# policies under them (PolicyKind::untouched_by), and the runs a report made before that rule are
# left out here, so that every batch of a matrix counts alike.
UNTOUCHED = {
    "kill-crabd": (["off", "chat-only", "every-turn"],
                   "their shims save nothing and never start or use crabd: each run would be a fault-free run"),
}

# The paper's headline figures, shown beside ours.
PAPER = {
    "correctness": "chat-only 8% -> crab 100%",
    "traffic": "up to 87% less checkpoint traffic than every-turn",
    "run_time": "within 1.9% of fault-free run time",
}


# How each fault strikes and how each policy recovers: the rules the figures above were measured under.
FAULT_MODEL = [
    "How each fault strikes (after the fault turn's checkpoint is durable) and how the policies recover:", "",
    "- kill-processes: SIGKILL to every process of the sandbox. off: lost; chat-only: a fresh sandbox from "
    "the base image (off saves nothing either and goes on in the same fresh sandbox: where both policies are "
    "replayed, off's report is chat-only's run with the sandbox counted as lost); every-turn: `ctr containers restore` of its last `ctr containers checkpoint --task --rw` "
    "image; crab: `crabctl recover` (the container recreated with `io.crab.restore-from`).",
    "- kill-shim: SIGKILL to the sandbox's shim (the parent of its init); containerd reports the task gone "
    "and the policies recover as above.",
    "- restart-containerd: SIGKILL to containerd (the process listening on its socket), then its start "
    "command; shims and tasks keep running, so every policy finds the task RUNNING and recovers nothing; the "
    "oracle still compares the state and every later turn, which run through the restarted containerd.",
    "- kill-crabd: SIGKILL to crabd (the process on `node.socket`); sandboxes keep running. For crab the "
    "run is only correct if every later turn's checkpoint was taken and `crabctl verify` passes on its chain. "
    "The baselines are not run under it (n/a): their shims never start or use crabd.",
    "- containerd-state-loss: SIGKILL to the sandbox's processes and shim, then containerd forgets the "
    "container and its snapshot, and every-turn's checkpoint image in containerd's content store goes with it. "
    "every-turn keeps each checkpoint off the node too: after `ctr containers checkpoint` it copies the "
    "checkpoint's own blobs (index, CRIU image, rw layer, spec; not the base image, which a replacement node pulls "
    "like any image) into an OCI archive in a directory of the replay's own (`--checkpoint-dir`), synced before "
    "the previous one is dropped, and after the fault it brings the newest back with `ctr images import` and "
    "restores it. Those archived bytes count as its checkpoint bytes, beside what it wrote into containerd. crab "
    "recovers from its store under the state dir alone (`crabctl recover --image`).",
    "- node-loss: node A is gone. Once the fault turn's checkpoint is off the node (crab: its shim pushed it to "
    "the registry; every-turn: its push ended within the turn), SIGKILL to the sandbox's processes and shim, to crabd "
    "and to containerd; the crab sandbox's store, kept images and runc root (a crab config of its own) are "
    "deleted; containerd is started again without the sandbox, as a replacement node with the images. Every "
    "policy recovers on node B, a second containerd and crab on the same machine with directories of their "
    "own: crab with `crabctl recover --from <registry>/<namespace>/<sandbox>` (only what B's store lacks is "
    "pulled, every digest verified), every-turn from the checkpoint image it pushed to the same registry after "
    "every turn (`ctr images push` of `<registry>/every-turn/<sandbox>:turn-N`, part of the turn's cost; no "
    "archive in these runs), fetched into B's containerd with `ctr content fetch` (a pull without the unpack, "
    "which a checkpoint index fails), chat-only from the base image there. The later turns run on node B. "
    "every-turn's pushed bytes are what each push sent: the sizes of the blobs (and manifests) the registry's "
    "repository lacked, asked with HEAD just before the push as containerd's pusher asks; they count as its "
    "checkpoint bytes, beside what it wrote into containerd, as the archive does under the other faults. "
    "crab's pushed bytes are what its shim uploaded for each turn it pushed from node A (the push log's "
    "`bytes_uploaded`: the packs and pack indexes of the chunks the registry lacked, the turn manifest and the OCI "
    "manifest), read from node A's log once the fault turn is in the registry, before node A goes, and from node "
    "B's at the end of the run where node B pushes; they are not part "
    "of crab's written or charged bytes.",
    "",
]


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


def load_reports(raw_dir, meta=None):
    """The trace reports under raw_dir, and the ones left out because a rerun
    batch replaced them: a batch whose meta lists `replaces` (batch names)
    stands for those batches' reports of the same trace and fault kind."""
    by_batch = {}
    for path in sorted(raw_dir.rglob("*.json")):
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as error:
            raise EvalInputError(f"{path}: not JSON: {error}") from error
        if not isinstance(data, list):
            raise EvalInputError(f"{path}: expected a list of trace reports")
        batch = path.parent.relative_to(raw_dir).as_posix()
        by_batch.setdefault("run" if batch == "." else batch, []).extend(data)
    replaced_keys = {}
    for batch, values in (meta or {}).items():
        replaces = values.get("replaces") or []
        if isinstance(replaces, str):
            replaces = [name for name in replaces.split(",") if name]
        for old in replaces:
            if old not in by_batch:
                raise EvalInputError(f"batch {batch} replaces batch {old}, which has no results under {raw_dir}")
            for report in by_batch.get(batch, []):
                replaced_keys.setdefault(old, {})[(report["trace"], report.get("fault", "none"))] = batch
    reports, replaced = [], []
    for batch, batch_reports in by_batch.items():
        for report in batch_reports:
            by = replaced_keys.get(batch, {}).get((report["trace"], report.get("fault", "none")))
            if by is None:
                reports.append(report)
            else:
                replaced.append({"batch": batch, "trace": report["trace"], "fault": report.get("fault", "none"), "by": by})
    return reports, replaced


def leave_out_untouched(reports):
    """Drops from `reports` the runs of policies their fault has nothing to strike in (see
    UNTOUCHED) and returns what is not run: {fault: {policy: why}}, with the reports' own
    `not_run` entries."""
    not_run = {}
    for report in reports:
        fault = report.get("fault", "none")
        untouched, why = UNTOUCHED.get(fault, ([], None))
        for entry in report.get("not_run") or []:
            not_run.setdefault(fault, {})[entry["policy"]] = why or entry["why"]
        for run in report["runs"]:
            if run["policy"] in untouched:
                not_run.setdefault(fault, {})[run["policy"]] = why
        report["runs"] = [run for run in report["runs"] if run["policy"] not in untouched]
    return {fault: dict(sorted(policies.items(), key=lambda item: rank(POLICY_ORDER, item[0])))
            for fault, policies in not_run.items()}


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


def load_meta(out):
    """meta.json of a single batch, or meta/<batch>.json of several."""
    batches = {}
    if (out / "meta.json").exists():
        batches["run"] = json.loads((out / "meta.json").read_text())
    if (out / "meta").is_dir():
        for path in sorted((out / "meta").glob("*.json")):
            batches[path.stem] = json.loads(path.read_text())
    return batches


def rank(order, name):
    return order.index(name) if name in order else len(order)


def pct(part, whole):
    return 100.0 * part / whole if whole else None


def ratio(part, whole):
    return part / whole if whole else None


def unstable_traces(reports):
    """Traces the oracle cannot judge: `off` lost nothing (its sandbox survived
    the fault) and was still found to differ from the reference, so the trace
    differs from run to run in a way the reference runs did not show
    (e.g. `ls -l` times of the minute the turn ran in)."""
    unstable = set()
    for report in reports:
        for run in report["runs"]:
            fault = run.get("fault") or {}
            if (run["policy"] == "off" and run["recovered_correctly"] is False
                    and (fault.get("recovery") or {}).get("method") == "not-needed"):
                unstable.add(report["trace"])
    return sorted(unstable)


def correctness_cells(reports):
    correctness = {}
    for report in reports:
        for run in report["runs"]:
            if run["recovered_correctly"] is None:
                continue
            cell = correctness.setdefault(run["policy"], {}).setdefault(
                report.get("fault", "none"), {"correct": 0, "faulted": 0, "failed": []})
            cell["faulted"] += 1
            if run["recovered_correctly"]:
                cell["correct"] += 1
            else:
                cell["failed"].append(report["trace"])
    for cells in correctness.values():
        for cell in cells.values():
            cell["pct"] = pct(cell["correct"], cell["faulted"])
    return {name: dict(sorted(cells.items(), key=lambda item: rank(FAULT_ORDER, item[0])))
            for name, cells in sorted(correctness.items(), key=lambda item: rank(POLICY_ORDER, item[0]))}


def oracle_summary(reports):
    """What the oracle compared, excluded as nondeterministic and matched only
    after normalising (wall-clock stamps, stderr line order), per policy over
    its judged faulted runs and per trace from the reference runs; and where the
    output of each incorrect run first differed."""
    policies = {}
    traces = {}
    differences = []
    state_differences = []
    for report in reports:
        reference = report.get("reference") or {}
        traces.setdefault(report["trace"], {
            "turns": report["turns"],
            "nondeterministic_turns": reference.get("nondeterministic_turns", []),
            "normalised_turns": reference.get("normalised_turns", []),
            "turns_with_wall_clock": reference.get("turns_with_wall_clock", []),
            "unsettled_turns": reference.get("unsettled_turns", []),
            "state_changes": reference.get("state_changes"),
        })
        for run in report["runs"]:
            verdict = (run.get("fault") or {}).get("verdict")
            if not verdict:
                continue
            stats = policies.setdefault(run["policy"], {
                "verdicts": 0, "turns_compared": 0, "turns_excluded": 0, "normalised_wall_clock": 0,
                "normalised_stderr_order": 0, "normalised_apt_progress": 0, "rc_mismatches": 0, "output_mismatches": 0,
                "states_compared": 0, "states_excluded": 0, "states_unsettled": 0, "state_mismatches": 0})
            stats["verdicts"] += 1
            for key, field in [("turns_compared", "turns_compared"), ("turns_excluded", "turns_excluded"),
                               ("normalised_wall_clock", "turns_normalised_wall_clock"),
                               ("normalised_stderr_order", "turns_normalised_stderr_order"),
                               ("normalised_apt_progress", "turns_normalised_apt_progress"),
                               ("rc_mismatches", "rc_mismatches"), ("output_mismatches", "output_mismatches"),
                               ("states_compared", "states_compared"), ("states_excluded", "states_excluded"),
                               ("states_unsettled", "states_unsettled"), ("state_mismatches", "state_mismatches")]:
                stats[key] += len(verdict.get(field) or [])
            if run["recovered_correctly"] is False:
                for difference in (verdict.get("output_differences") or [])[:3]:
                    differences.append({"trace": report["trace"], "fault": report.get("fault", "none"),
                                        "policy": run["policy"], **difference})
                mismatches = verdict.get("state_mismatches") or []
                for difference in (verdict.get("later_state_differences") or [])[:3]:
                    state_differences.append({"trace": report["trace"], "fault": report.get("fault", "none"),
                                              "policy": run["policy"], "turn": mismatches[0], **difference})
    return {
        "policies": {name: policies[name] for name in sorted(policies, key=lambda n: rank(POLICY_ORDER, n))},
        "traces": dict(sorted(traces.items())),
        "state_changes": state_changes_summary(traces),
        "output_differences": differences,
        "later_state_differences": state_differences,
    }


def state_changes_summary(traces):
    """What the turns of the first reference runs changed, summed over the traces whose reports
    record it: turns looked at, turns that changed the sandbox's state, and of those the turns
    that changed files outside the working directory, /tmp and /root, or processes and sockets:
    what the replay's first oracle (the files under those three directories) could not see."""
    total = {"traces": 0, "traces_without": 0, "turns_seen": 0, "turns_changed": 0,
             "files_outside_old_scope": 0, "processes_or_sockets": 0, "unseen_by_old_oracle": 0}
    for info in traces.values():
        changes = info.get("state_changes")
        if not changes:
            total["traces_without"] += 1
            continue
        total["traces"] += 1
        total["turns_seen"] += changes["turns_seen"]
        total["turns_changed"] += len(changes["turns_changed"])
        total["files_outside_old_scope"] += len(changes["files_outside_old_scope"])
        total["processes_or_sockets"] += len(changes["processes_or_sockets"])
        total["unseen_by_old_oracle"] += len(set(changes["files_outside_old_scope"])
                                             | set(changes["processes_or_sockets"]))
    return total


def pushed_to_registry(run):
    """What a run pushed to the registry (every-turn's `ctr images push`es, crab's shim), or None
    when the run's report has no such figure (crab in reports from before crab-replay read them)."""
    if run.get("checkpoint_exported_to") != "registry":
        return None
    return run.get("checkpoint_exported_bytes", 0)


def node_loss_pushed(reports):
    """crab's pushed bytes against every-turn's in the same node-loss reports: over all turns, and
    over the turns up to the fault turn, which both pushed from node A (after it crab pushes only
    where node B's config says so, every-turn after every turn)."""
    every = {"runs": 0, "crab_bytes": 0, "every_turn_bytes": 0}
    early = {"runs": 0, "turns": 0, "crab_bytes": 0, "every_turn_bytes": 0}
    notes, without = [], 0
    for report in reports:
        if report.get("fault") != "node-loss":
            continue
        by_policy = {run["policy"]: run for run in report["runs"]}
        crab, every_turn = by_policy.get("crab"), by_policy.get("every-turn")
        if crab is None or every_turn is None:
            continue
        crab_pushed, every_turn_pushed = pushed_to_registry(crab), pushed_to_registry(every_turn)
        if crab_pushed is None or every_turn_pushed is None:
            without += 1
            continue
        every["runs"] += 1
        every["crab_bytes"] += crab_pushed
        every["every_turn_bytes"] += every_turn_pushed
        fault_turn = report.get("fault_turn")
        if fault_turn is not None:
            def before(run):
                return sum(turn.get("checkpoint_exported_bytes", 0) for turn in run["turns"]
                           if turn["turn"] <= fault_turn and turn.get("checkpoint_exported_to") == "registry")
            early["runs"] += 1
            early["turns"] += fault_turn
            early["crab_bytes"] += before(crab)
            early["every_turn_bytes"] += before(every_turn)
        if crab.get("pushed_note"):
            notes.append(f"{report['trace']}: crab: {crab['pushed_note']}")
    if not every["runs"] and not without:
        return None
    for cell in (every, early):
        cell["crab_vs_every_turn"] = ratio(cell["crab_bytes"], cell["every_turn_bytes"])
    return {**every, "up_to_fault_turn": early, "runs_without_crab_figures": without, "notes": notes}


def off_node_bytes(stats):
    """What a policy's checkpoints sent off the node: archived + pushed, or the one there is."""
    archived, pushed = stats["checkpoint_archived_bytes"], stats["checkpoint_pushed_bytes"]
    if archived and pushed:
        return f"{human_bytes(archived)} + {human_bytes(pushed)} pushed"
    if pushed:
        return f"{human_bytes(pushed)} pushed"
    return human_bytes(archived)


def retried(error, reports, meta):
    """Whether a report stands for the trace `error` says failed: one of the same trace in the
    failed batch's mode at its think-time scale (a batch stopped mid-trace and resumed, or a
    later batch like it), not one of another kind of batch sharing the output directory."""
    settings = (meta or {}).get(error.get("batch"), {})
    mode, scale = settings.get("mode"), settings.get("think-time scale")
    return any(report["trace"] == error["trace"]
               and (mode is None or report.get("mode", "exec") == mode)
               and (scale is None or float(report.get("think_scale", 0.0)) == float(scale))
               for report in reports)


def aggregate(reports, errors, classes, meta=None):
    policies = {}
    run_time = {}
    for report in reports:
        fault = report.get("fault", "none")
        scale = report.get("think_scale", 0.0)
        by_policy = {run["policy"]: run for run in report["runs"]}
        every_turn = by_policy.get("every-turn")
        off = by_policy.get("off")
        for name, run in by_policy.items():
            stats = policies.setdefault(name, {
                "runs": 0, "faulted": 0, "correct": 0,
                "availability_faulted": 0, "availability_correct": 0,
                "checkpoints": 0, "checkpoint_failures": 0, "checkpoint_bytes": 0, "checkpoint_exported_bytes": 0,
                "checkpoint_archived_bytes": 0, "checkpoint_pushed_bytes": 0,
                "charged_bytes": 0, "referenced_bytes": 0, "runs_without_store_check": 0,
                "paired_bytes": 0, "every_turn_bytes": 0, "every_turn_containerd_bytes": 0,
                "delays": [], "first_checkpoint_error": None,
            })
            stats["runs"] += 1
            stats["checkpoints"] += run["checkpoints"]
            stats["checkpoint_failures"] += run["checkpoint_failures"]
            stats["checkpoint_bytes"] += run["checkpoint_bytes"]
            stats["checkpoint_exported_bytes"] += run.get("checkpoint_exported_bytes", 0)
            # Off the node: pushed to the registry (every-turn in node-loss runs) or archived.
            off_node = "pushed" if run.get("checkpoint_exported_to") == "registry" else "archived"
            stats[f"checkpoint_{off_node}_bytes"] += run.get("checkpoint_exported_bytes", 0)
            charged = charged_bytes(run)
            stats["charged_bytes"] += charged
            store = run.get("store")
            if store is not None:
                stats["referenced_bytes"] += store.get("bytes") or 0
                stats["runs_without_store_check"] += 0 if store.get("ok") else 1
            if every_turn is not None:
                stats["paired_bytes"] += charged
                stats["every_turn_bytes"] += every_turn["checkpoint_bytes"]
                stats["every_turn_containerd_bytes"] += (every_turn["checkpoint_bytes"]
                                                         - every_turn.get("checkpoint_exported_bytes", 0))
            stats["delays"].extend(turn["agent_visible_delay_s"] for turn in run["turns"])
            if stats["first_checkpoint_error"] is None:
                stats["first_checkpoint_error"] = next(
                    (f"{report['trace']} turn {turn['turn']}: {turn['checkpoint_error']}"
                     for turn in run["turns"] if turn.get("checkpoint_error")), None)
            if run["recovered_correctly"] is not None:
                prefix = "availability_" if fault in AVAILABILITY else ""
                stats[prefix + "faulted"] += 1
                stats[prefix + "correct"] += 1 if run["recovered_correctly"] else 0
            if off is not None:
                kind = "fault-free" if fault == "none" else "faulted"
                group = run_time.setdefault(f"{kind} x{scale:g}", {}).setdefault(name, {"run_time_s": 0.0, "off_s": 0.0, "runs": 0})
                group["run_time_s"] += run["run_time_s"]
                group["off_s"] += off["run_time_s"]
                group["runs"] += 1

    # Replication (runs that push off the node): per think-time scale, turns looked at and
    # those whose saved state was in the registry when the next turn started.
    replication = {}
    for report in reports:
        for run in report["runs"]:
            if run.get("replication"):
                cell = replication.setdefault(f"{run['policy']} x{report.get('think_scale', 0.0):g}",
                                              {"turns": 0, "off_node_in_time": 0})
                cell["turns"] += run["replication"]["turns"]
                cell["off_node_in_time"] += run["replication"]["off_node_in_time"]
    for cell in replication.values():
        cell["pct"] = pct(cell["off_node_in_time"], cell["turns"])

    summary = {}
    for name in sorted(policies, key=lambda n: rank(POLICY_ORDER, n)):
        stats = policies[name]
        delays = stats.pop("delays")
        summary[name] = {
            **stats,
            "correct_pct": pct(stats["correct"], stats["faulted"]),
            "availability_pct": pct(stats["availability_correct"], stats["availability_faulted"]),
            "bytes_vs_every_turn": ratio(stats["paired_bytes"], stats["every_turn_bytes"]),
            "bytes_vs_every_turn_in_containerd": ratio(stats["paired_bytes"], stats["every_turn_containerd_bytes"]),
            "delay_p50_s": percentile(delays, 0.50),
            "delay_p99_s": percentile(delays, 0.99),
            "delay_max_s": max(delays) if delays else None,
            "turns": len(delays),
        }
    unstable = unstable_traces(reports)
    for groups in run_time.values():
        for group in groups.values():
            group["vs_off"] = ratio(group["run_time_s"], group["off_s"])

    class_counts = {name: 0 for name in CLASS_ORDER}
    class_bytes = 0
    for row in classes:
        class_counts[row["class"]] = class_counts.get(row["class"], 0) + 1
        class_bytes += row.get("bytes") or 0
    total_classified = sum(class_counts.values())
    return {
        "modes": mode_summary(reports, classes),
        "traces": len({report["trace"] for report in reports}),
        "reports": len(reports),
        # A trace that failed in one batch and was reported by a later one is not a failure of the
        # matrix (a batch stopped mid-trace, a containerd lost under it): shown apart.
        "failed_traces": [error for error in errors if not retried(error, reports, meta)],
        "failures_retried": [error for error in errors if retried(error, reports, meta)],
        "policies": summary,
        "correctness": correctness_cells(reports),
        "oracle_unstable_traces": unstable,
        "correctness_judgeable": correctness_cells([r for r in reports if r["trace"] not in unstable]),
        "oracle": oracle_summary(reports),
        "run_time_vs_off": dict(sorted(run_time.items())),
        "replication": dict(sorted(replication.items())),
        "node_loss_pushed": node_loss_pushed(reports),
        "classes": {
            "turns": total_classified,
            "counts": class_counts,
            "pct": {name: pct(count, total_classified) for name, count in class_counts.items()},
            "bytes": class_bytes,
        } if total_classified else None,
    }


def charged_bytes(run):
    """What a policy run is charged for its checkpoints. Crab's store deduplicates across every
    sandbox of a batch, so what a run wrote can be far less than what its checkpoints need (a
    turn identical to another run's costs nothing): a run with a store of its own is charged
    everything its chain references (`crabctl verify`), or what it wrote if that is more.
    every-turn writes each checkpoint whole, into containerd and out of it (both counted)."""
    if "checkpoint_charged_bytes" in run:
        return run["checkpoint_charged_bytes"]
    # Reports of replays from before the field existed.
    store = run.get("store") or {}
    return max(run["checkpoint_bytes"], store.get("bytes") or 0)


def human_bytes(count):
    value = float(count)
    for unit in ["B", "KiB", "MiB", "GiB"]:
        if value < 1024 or unit == "GiB":
            return f"{count} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{count} B"


def fmt(value, pattern, missing="-"):
    return missing if value is None else pattern.format(value)


def correctness_table(correctness, kinds=None, total="all faults", not_run=None):
    """Per policy and fault kind, the faults among `kinds` (every kind when None), with their
    total; `n/a` where `not_run` ({fault: {policy: why}}) says the policy was not run, followed
    by why."""
    not_run = not_run or {}
    faults = sorted({fault for cells in correctness.values() for fault in cells if kinds is None or fault in kinds},
                    key=lambda fault: rank(FAULT_ORDER, fault))
    if not faults:
        return ["No faulted runs.", ""]
    correctness = {name: {fault: cell for fault, cell in cells.items() if fault in faults}
                   for name, cells in correctness.items()}
    for fault in faults:
        for name in not_run.get(fault, {}):
            correctness.setdefault(name, {})
    correctness = dict(sorted(correctness.items(), key=lambda item: rank(POLICY_ORDER, item[0])))
    lines = ["| policy | " + " | ".join(faults) + f" | {total} |",
             "|---|" + "---|" * (len(faults) + 1)]
    for name, cells in correctness.items():
        row = [f"{fmt(cells[f]['pct'], '{:.0f}%')} ({cells[f]['correct']}/{cells[f]['faulted']})"
               if f in cells else "n/a" if name in not_run.get(f, {}) else "-" for f in faults]
        correct = sum(cell["correct"] for cell in cells.values())
        faulted = sum(cell["faulted"] for cell in cells.values())
        row.append(f"**{fmt(pct(correct, faulted), '{:.0f}%')}** ({correct}/{faulted})" if faulted else "n/a")
        lines.append(f"| {name} | " + " | ".join(row) + " |")
    lines.append("")
    for fault in faults:
        reasons = {}
        for name, why in not_run.get(fault, {}).items():
            reasons.setdefault(why, []).append(name)
        for why, names in reasons.items():
            lines += [f"n/a: {fault} is not run for {', '.join(names)}: {why}.", ""]
    failures = [(name, fault, cell["failed"]) for name, cells in correctness.items()
                for fault, cell in cells.items() if cell["failed"]]
    if failures:
        lines += ["Incorrect recoveries (trace names):", ""]
        for name, fault, traces in failures:
            lines.append(f"- {name} / {fault}: {', '.join(sorted(set(traces)))}")
        lines.append("")
    return lines


def mode_summary(reports, classes):
    """Per replay mode (exec, stdin, tmux) and policy: recoveries, checkpoints, bytes; and
    crab's turn classes per mode (reports and class rows without a mode are exec)."""
    modes = {}
    for report in reports:
        mode = report.get("mode", "exec")
        for run in report["runs"]:
            stats = modes.setdefault(mode, {"policies": {}, "classes": {}})["policies"].setdefault(
                run["policy"], {"runs": 0, "faulted": 0, "correct": 0, "checkpoints": 0, "checkpoint_bytes": 0,
                                "turns": 0})
            stats["runs"] += 1
            stats["turns"] += len(run["turns"])
            stats["checkpoints"] += run["checkpoints"]
            stats["checkpoint_bytes"] += run["checkpoint_bytes"]
            if run["recovered_correctly"] is not None:
                stats["faulted"] += 1
                stats["correct"] += 1 if run["recovered_correctly"] else 0
    for row in classes:
        counts = modes.setdefault(row.get("mode", "exec"), {"policies": {}, "classes": {}})["classes"]
        counts[row["class"]] = counts.get(row["class"], 0) + 1
    return dict(sorted(modes.items(), key=lambda item: rank(MODE_ORDER, item[0])))


MODE_ORDER = ["exec", "stdin", "tmux"]


def mode_lines(modes):
    if not modes or set(modes) == {"exec"}:
        return []
    lines = ["## Per replay mode", "",
             "exec: each command its own exec; stdin: one bash session fed every command through its stdin "
             "(SWE-agent, OpenHands); tmux: every command typed into a tmux session (Terminus). Crab's classes "
             "are of every turn the crab shim recorded (a stdin session makes one per command).", "",
             "| mode | policy | runs | turns | recovered correctly | checkpoints | written | crab classes clean / fs / proc |",
             "|---|---|---|---|---|---|---|---|"]
    for mode, values in modes.items():
        counts = values["classes"]
        total = sum(counts.values())
        classes = (" / ".join(f"{counts.get(name, 0)} ({pct(counts.get(name, 0), total):.0f}%)"
                              for name in CLASS_ORDER) if total else "-")
        for name in sorted(values["policies"], key=lambda n: rank(POLICY_ORDER, n)):
            stats = values["policies"][name]
            correct = f"{stats['correct']}/{stats['faulted']}" if stats["faulted"] else "-"
            lines.append(f"| {mode} | {name} | {stats['runs']} | {stats['turns']} | {correct} | {stats['checkpoints']} "
                         f"| {human_bytes(stats['checkpoint_bytes'])} | {classes if name == 'crab' else '-'} |")
    return lines + [""]


def render_markdown(summary, meta):
    lines = ["# Crab evaluation", ""]
    for batch, values in meta.items():
        lines.append(f"- batch `{batch}`: " + "; ".join(f"{key}: {value}" for key, value in values.items()))
    lines += [f"- traces replayed: {summary['traces']} ({summary['reports']} trace x fault reports), "
              f"failed: {len(summary['failed_traces'])}"
              + (f" ({len(summary['failures_retried'])} more failed once and were reported by a later batch)"
                 if summary.get("failures_retried") else "")]
    replaced = summary.get("replaced_reports") or []
    if replaced:
        pairs = sorted({(r["batch"], r["by"], r["fault"]) for r in replaced})
        lines += [f"- rerun: {len([r for r in replaced if (r['batch'], r['by'], r['fault']) == pair])} {pair[2]} "
                  f"report(s) of batch `{pair[0]}` replaced by batch `{pair[1]}` (the replaced results stay in "
                  f"raw/{pair[0]}/, they are not counted)" for pair in pairs]
    lines.append("")

    lines += ["## Recovery correctness per policy and fault kind", "",
              "Faults that destroy the sandbox's state (" + ", ".join(STATE_DESTROYING) + "); the headline:", ""]
    lines += correctness_table(summary["correctness"], STATE_DESTROYING, "state-destroying faults")
    lines += ["Availability checks (" + ", ".join(AVAILABILITY) + "): the sandbox keeps running through these, "
              "so every policy keeps its state; what is checked is that the sandbox still answers and, for crab, "
              "that every later turn is still checkpointed:", ""]
    lines += correctness_table(summary["correctness"], AVAILABILITY, "availability faults", summary.get("not_run"))
    if summary["oracle_unstable_traces"]:
        lines += ["Without the traces the oracle cannot judge (`off` lost nothing in a fault, its sandbox kept "
                  "running, and it still differed from the reference: the trace's output changes from run to run "
                  "in a way the reference runs did not catch): "
                  + ", ".join(f"`{trace}`" for trace in summary["oracle_unstable_traces"]), ""]
        lines += correctness_table(summary["correctness_judgeable"], STATE_DESTROYING, "state-destroying faults")
    lines += FAULT_MODEL
    lines += mode_lines(summary.get("modes"))
    lines += oracle_lines(summary["oracle"], meta)

    lines += [
        "## Per policy", "",
        "| policy | recovered correctly (state-destroying) | availability | checkpoints (failed) | written "
        "| charged | off the node (archived + pushed) | bytes vs every-turn | vs its containerd part | delay p50 / turn "
        "| delay p99 / turn | delay max |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, stats in summary["policies"].items():
        correct = (f"{stats['correct_pct']:.0f}% ({stats['correct']}/{stats['faulted']})"
                   if stats["faulted"] else "- (no fault)")
        available = (f"{stats['availability_pct']:.0f}% ({stats['availability_correct']}/"
                     f"{stats['availability_faulted']})" if stats["availability_faulted"] else "-")
        lines.append(
            f"| {name} | {correct} | {available} | {stats['checkpoints']} ({stats['checkpoint_failures']}) "
            f"| {human_bytes(stats['checkpoint_bytes'])} | {human_bytes(stats['charged_bytes'])} "
            f"| {off_node_bytes(stats)} "
            f"| {fmt(stats['bytes_vs_every_turn'], '{:.3f}x')} "
            f"| {fmt(stats['bytes_vs_every_turn_in_containerd'], '{:.3f}x')} "
            f"| {fmt(stats['delay_p50_s'], '{:.3f} s')} | {fmt(stats['delay_p99_s'], '{:.3f} s')} "
            f"| {fmt(stats['delay_max_s'], '{:.3f} s')} |"
        )
    lines += [
        "",
        "Written: what the policy's checkpoints wrote. Charged: what each run is charged, written or, for a "
        "policy with a store of its own (crab), everything its checkpoint chain references (`crabctl verify`), "
        "whichever is more: crab's store deduplicates across all runs of a batch, so a run can write almost "
        "nothing for a turn another run already stored. Bytes vs every-turn: the policy's charged bytes over "
        "every-turn's in the same (trace, fault) reports; every-turn's include its copy off the node (\"off the "
        "node\", part of its written bytes: the archives it writes out of containerd, and in node-loss runs what "
        "its `ctr images push`es sent the registry instead, the blobs the registry lacked); crab's \"off the "
        "node\" is what its shim pushed to the registry in node-loss runs, on top of its written bytes and not "
        "counted in them or in its charged bytes; \"vs its containerd part\" leaves "
        "that copy out (every-turn as it "
        "would be without node loss in its fault model). Delay: what the agent waited for the policy's checkpoint beyond its (scaled) think time "
        "before the next turn; with think times scaled to 0 it is the whole checkpoint time.",
        "",
    ]

    lines += ["## Run time vs off", "",
              "| runs | policy | run time | off | ratio | runs compared |", "|---|---|---|---|---|---|"]
    for group, policies in summary["run_time_vs_off"].items():
        for name in sorted(policies, key=lambda n: rank(POLICY_ORDER, n)):
            stats = policies[name]
            lines.append(f"| {group} | {name} | {stats['run_time_s']:.1f} s | {stats['off_s']:.1f} s "
                         f"| {fmt(stats['vs_off'], '{:.3f}x')} | {stats['runs']} |")
    lines += ["", "Each policy's run against the `off` run of the same trace and fault, summed; x<scale> is "
              "the factor the recorded think times were replayed at. Fault-free runs measure the overhead; "
              "faulted ones also include the fault and the recovery.", ""]

    pushed = summary.get("node_loss_pushed")
    if pushed:
        lines += ["## Pushed to the registry in node-loss runs", "",
                  "| turns | runs | crab pushed | every-turn pushed | crab / every-turn |", "|---|---|---|---|---|"]
        for label, cell in (("all turns", pushed), ("up to the fault turn (node A)", pushed["up_to_fault_turn"])):
            lines.append(f"| {label} | {cell['runs']} | {human_bytes(cell['crab_bytes'])} "
                         f"| {human_bytes(cell['every_turn_bytes'])} | {fmt(cell['crab_vs_every_turn'], '{:.3f}x')} |")
        lines += ["", "crab pushed: what its shim uploaded to the registry by itself (`[remote] auto_push`), per turn "
                  "the `bytes_uploaded` of its push log (the packs and pack indexes of the chunks the registry "
                  "lacked, the turn manifest and the OCI manifest). every-turn pushed: what its `ctr images push` of "
                  "each turn's checkpoint image sent (the blobs and manifests the repository lacked). Both pushed "
                  "every turn up to the fault turn from node A; after it every-turn pushes from node B, crab only "
                  "where node B's crab config has auto_push, so the second row compares the turns both pushed."]
        if pushed["runs_without_crab_figures"]:
            lines.append(f"{pushed['runs_without_crab_figures']} node-loss run(s) left out: their report has no "
                         "pushed bytes of crab's or every-turn's (replays from before crab-replay read them).")
        lines += [""] + [f"- {note}" for note in pushed["notes"]] + ([""] if pushed["notes"] else [])

    if summary.get("replication"):
        lines += ["## Replication off the node", "",
                  "| runs | turns looked at | off the node when the next turn started |", "|---|---|---|"]
        for group, cell in summary["replication"].items():
            lines.append(f"| {group} | {cell['turns']} | {cell['off_node_in_time']} "
                         f"({fmt(cell['pct'], '{:.1f}%')}) |")
        lines += ["", "node-loss runs push every checkpointed turn to the registry by themselves (the shim's "
                  "queue): at the start of each next turn, on node A, the replay looks whether the newest "
                  "checkpoint is in the registry. x<scale> is the think-time factor: with 0 the next turn "
                  "starts as soon as the checkpoint is taken.", ""]

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
    chat, crab = policies.get("chat-only"), policies.get("crab")
    ours_correct = (f"chat-only {fmt(chat and chat['correct_pct'], '{:.0f}%', 'n/a')} -> "
                    f"crab {fmt(crab and crab['correct_pct'], '{:.0f}%', 'n/a')} (state-destroying faults)")
    cut = crab and crab["bytes_vs_every_turn"]
    cut_local = crab and crab["bytes_vs_every_turn_in_containerd"]
    ours_traffic = f"{(1 - cut):.1%} less than every-turn ({cut:.3f}x)" if cut is not None else "n/a"
    if cut is not None and cut_local is not None:
        ours_traffic += f"; {cut_local:.3f}x its writes into containerd alone"
    lines += [
        f"| recovery correctness | {PAPER['correctness']} | {ours_correct} |",
        f"| checkpoint traffic | {PAPER['traffic']} | {ours_traffic} |",
        f"| run time | {PAPER['run_time']} | {headline_run_time(summary)} |",
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


def oracle_lines(oracle, meta):
    if not oracle["policies"]:
        return []
    spacings = sorted({values["reference spacing (s)"] for values in meta.values() if "reference spacing (s)" in values})
    spacing = (f" The reference runs of a trace started at least {' / '.join(spacings)} s apart, so clock "
               "output the normaliser does not know shows up as nondeterministic." if spacings else "")
    lines = ["## What the oracle compared", "",
             "Turns after the fault, summed over each policy's judged runs: compared, excluded as "
             "nondeterministic (they differed between the fault-free reference runs), and compared turns "
             "that matched the reference only after normalising: wall-clock stamps replaced (`ls -l` times, "
             "`date`, ISO 8601, HTTP and log dates, HH:MM:SS), stderr taken in any line order (the members of "
             "a pipeline write to it concurrently), or apt's progress lines (`Get:3 ...`, `Ign:1 ...`) in any "
             "order within each block of them, numbers left out (its parallel fetches end in any order). The state after each of those turns (the whole sandbox, "
             "as right after recovery) is compared too, with what differed between the reference runs after "
             "that turn masked (but files whose names alone differed, such as `tempfile`'s: each must have a "
             "file like it under a name of the run's own), up to the first turn excluded as nondeterministic: "
             "the states from there on are "
             "excluded, as they carry what that turn left, of which the reference runs show only some. "
             "After every turn each run waits, up to the agent's recorded think time (1 to 10 s), for what the "
             "turn left running (a command cut off at its timeout, a job started with `&`) to be quiet, before "
             "the policy saves and the oracle looks; a state looked at while such a process was still busy "
             "(in the reference or in the run) is not compared (unsettled), as what it had written by then "
             "depends on the run's pace." + spacing, "",
             "| policy | judged runs | turns compared | excluded | matched after stamps | after stderr order "
             "| after apt progress order | exit code mismatches | output mismatches | states compared | states excluded | states unsettled "
             "| state mismatches |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, stats in oracle["policies"].items():
        lines.append(f"| {name} | {stats['verdicts']} | {stats['turns_compared']} | {stats['turns_excluded']} "
                     f"| {stats['normalised_wall_clock']} | {stats['normalised_stderr_order']} "
                     f"| {stats.get('normalised_apt_progress', 0)} "
                     f"| {stats['rc_mismatches']} | {stats['output_mismatches']} "
                     f"| {stats['states_compared']} | {stats['states_excluded']} | {stats.get('states_unsettled', 0)} "
                     f"| {stats['state_mismatches']} |")
    lines += ["", "Per trace, from the reference runs (turn numbers):", "",
              "| trace | turns | nondeterministic (excluded) | print the clock | differed only in stamps or stderr order "
              "| unsettled |",
              "|---|---|---|---|---|---|"]
    for trace, info in oracle["traces"].items():
        lines.append(f"| {trace} | {info['turns']} | {turn_list(info['nondeterministic_turns'])} "
                     f"| {turn_list(info['turns_with_wall_clock'])} | {turn_list(info['normalised_turns'])} "
                     f"| {turn_list(info.get('unsettled_turns', []))} |")
    lines.append("")
    changes = oracle.get("state_changes") or {}
    if changes.get("traces"):
        def traces(n):
            return f"{n} trace" + ("" if n == 1 else "s")
        without = (f" ({traces(changes['traces_without'])} replayed before crab-replay recorded it left out)"
                   if changes["traces_without"] else "")
        lines += [f"What the turns changed, in the first reference run of {traces(changes['traces'])}{without} "
                  "(the sandbox's whole state before and after each turn): of "
                  f"{changes['turns_seen']} turns, {changes['turns_changed']} changed it; "
                  f"{changes['files_outside_old_scope']} changed files outside the working directory, `/tmp` and "
                  f"`/root`, and {changes['processes_or_sockets']} changed processes, listening sockets or "
                  f"connections: {changes['unseen_by_old_oracle']} turns changed state that an oracle of the files "
                  "under those three directories alone (the replay's first) could not see.", ""]
    lines += bullets("Where the output of incorrect runs first differed (normalised):",
                     [f"{d['policy']} / {d['fault']} / `{d['trace']}` turn {d['turn']} {d['stream']} line "
                      f"{d['line']}: expected `{d['expected']}`, got `{d['got']}`"
                      for d in oracle["output_differences"]])
    lines += bullets("Where the state of incorrect runs first differed after a later turn (the first three entries):",
                     [f"{d['policy']} / {d['fault']} / `{d['trace']}` after turn {d['turn']}: `{d['key']}`: "
                      f"{d['detail']}" for d in oracle["later_state_differences"]])
    return lines


def bullets(title, items):
    """A titled list of `items` for report.md, or nothing when there are none."""
    return [title, "", *(f"- {item}" for item in items), ""] if items else []


def turn_list(turns):
    return ", ".join(str(turn) for turn in turns) if turns else "-"


def headline_run_time(summary):
    """crab against off in fault-free runs at the largest think-time scale measured."""
    candidates = []
    for group, policies in summary["run_time_vs_off"].items():
        kind, _, scale = group.partition(" x")
        if kind == "fault-free" and policies.get("crab", {}).get("vs_off") is not None:
            candidates.append((float(scale), group, policies["crab"]["vs_off"]))
    if not candidates:
        return "n/a"
    scale, group, value = max(candidates)
    return f"{value - 1:+.1%} vs off (fault-free, think times x{scale:g})"


def svg_bars(title, unit, bars):
    """A horizontal bar chart; bars is a list of (label, value or None)."""
    width, left, row, top = 620, 230, 24, 40
    height = top + row * max(1, len(bars)) + 20
    values = [value for _, value in bars if value is not None]
    scale_max = max(values) if values and max(values) > 0 else 1.0
    plot_width = width - left - 110
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'font-family="sans-serif" font-size="12">',
        f'<text x="10" y="22" font-weight="bold">{escape(title)}</text>',
    ]
    for index, (label, value) in enumerate(bars):
        y = top + index * row
        parts.append(f'<text x="{left - 8}" y="{y + 14}" text-anchor="end">{escape(label)}</text>')
        if value is None:
            parts.append(f'<text x="{left + 4}" y="{y + 14}" fill="#888">n/a</text>')
            continue
        length = max(0.0, value) / scale_max * plot_width
        parts.append(f'<rect x="{left}" y="{y + 2}" width="{length:.1f}" height="{row - 7}" fill="#3b78c2"/>')
        parts.append(f'<text x="{left + length + 6:.1f}" y="{y + 14}">{escape(unit(value))}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def escape(text):
    return str(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def write_plots(summary, plots_dir):
    plots_dir.mkdir(parents=True, exist_ok=True)
    policies = summary["policies"]
    run_time_bars = [(f"{name} ({group})", None if stats["vs_off"] is None else 100.0 * (stats["vs_off"] - 1))
                     for group, groups in summary["run_time_vs_off"].items()
                     for name, stats in groups.items() if name != "off"]
    correctness_bars = [(f"{name} / {fault}", cell["pct"])
                        for name, cells in summary["correctness"].items() for fault, cell in cells.items()]
    plots = {
        "bytes.svg": svg_bars("Checkpoint bytes charged per policy", human_bytes,
                              [(name, stats["charged_bytes"]) for name, stats in policies.items()]),
        "run_time.svg": svg_bars("Run-time overhead vs off", lambda value: f"{value:+.1f}%",
                                 run_time_bars or [("no data", None)]),
        "correctness.svg": svg_bars("Recovered correctly", lambda value: f"{value:.0f}%",
                                    correctness_bars or [("no data", None)]),
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
        meta = load_meta(out)
        reports, replaced = load_reports(out / "raw", meta)
        not_run = leave_out_untouched(reports)
        summary = aggregate(reports, load_jsonl(out / "errors.jsonl"), load_classes(out / "classes"), meta)
        summary["replaced_reports"] = replaced
        summary["not_run"] = not_run
    except (EvalInputError, KeyError, TypeError, OSError, json.JSONDecodeError) as error:
        print(f"eval_report.py: error: {error!r}", file=sys.stderr)
        return 1
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "report.md").write_text(render_markdown(summary, meta))
    write_plots(summary, out / "plots")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
