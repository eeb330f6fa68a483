#!/usr/bin/env python3
"""Runs once more, alone, each test that failed in a `cargo test` run.

The integration suites drive a real containerd, runc, CRIU and the kernel's BPF
on a shared two-core machine, and containerd's own runc shim loses an exec's
output now and then. A test that fails and then passes alone is reported as
FLAKY (and stays visible in the log); one that fails again fails the run.

usage: rerun_failed.py CARGO_TEST_LOG [MAX_RERUNS]
  CARGO_TEST_LOG  what `cargo test --no-fail-fast` printed (stdout and stderr)
  MAX_RERUNS      more failures than this are not a flake: fail at once (default 3)

Test binaries are found through `cargo test --no-run --message-format=json`
(already built, so this is quick), and run from their package's directory with
CARGO_MANIFEST_DIR set, as cargo runs them. Exits 0 only if every failed test
passed on its rerun.
"""

import json
import os
import re
import subprocess
import sys

RUNNING = re.compile(r"^\s*Running (?:unittests )?(\S+) \((\S+)\)$")
FAILED = re.compile(r"^test (\S+) \.\.\. FAILED$")
RESULT = re.compile(r"^test result: (ok|FAILED)\.")
DOCTESTS = re.compile(r"^\s*Doc-tests \S+$")


def failures(log_path):
    """(binary as cargo printed it, test name) of every failed test, and the
    number of test binaries that failed without naming a test (a crash)."""
    found, unnamed = [], 0
    binary, named_here = None, 0
    with open(log_path, errors="replace") as log:
        text = log.read()
    for line in text.splitlines():
        if m := RUNNING.match(line):
            binary, named_here = m.group(2), 0
        elif DOCTESTS.match(line):
            # Doc-tests have no binary of their own to rerun: their failures count as unexplained.
            binary, named_here = None, 0
        elif m := FAILED.match(line):
            if binary:
                found.append((binary, m.group(1)))
                named_here += 1
            else:
                unnamed += 1
        elif (m := RESULT.match(line)) and m.group(1) == "FAILED" and named_here == 0:
            unnamed += 1
    # A binary that died (signal, abort) prints no result line at all: cargo
    # then says so in its summary.
    crashed = len(re.findall(r"process didn't exit successfully: .*\(signal:", text))
    return found, unnamed + crashed


def package_dirs():
    """Test executable path -> its package's manifest directory."""
    out = subprocess.run(
        ["cargo", "test", "--release", "--workspace", "--no-run", "--message-format=json"],
        check=True, capture_output=True, text=True,
    ).stdout
    dirs = {}
    for line in out.splitlines():
        try:
            msg = json.loads(line)
        except json.JSONDecodeError:
            continue
        if msg.get("reason") == "compiler-artifact" and msg.get("executable"):
            dirs[os.path.realpath(msg["executable"])] = os.path.dirname(msg["manifest_path"])
    return dirs


def main():
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    log_path = sys.argv[1]
    max_reruns = int(sys.argv[2]) if len(sys.argv) == 3 else 3
    found, unexplained = failures(log_path)
    if unexplained:
        print(f"[rerun] {unexplained} test binaries failed without naming a failed test: no rerun", flush=True)
        return 1
    if not found:
        print("[rerun] the run failed but no failed test is named (a build error?): no rerun", flush=True)
        return 1
    if len(found) > max_reruns:
        print(f"[rerun] {len(found)} tests failed, more than {max_reruns}: not a flake, no rerun", flush=True)
        return 1
    dirs = package_dirs()
    still_failing = []
    for binary, test in found:
        exe = os.path.realpath(binary)
        cwd = dirs.get(exe)
        if cwd is None:
            print(f"[rerun] {binary}: not a test binary of this workspace", flush=True)
            still_failing.append(test)
            continue
        print(f"[rerun] {test} ({os.path.basename(exe)}) once more, alone", flush=True)
        env = dict(os.environ, CARGO_MANIFEST_DIR=cwd)
        run = subprocess.run([exe, "--exact", test, "--test-threads=1"], cwd=cwd, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
        print(run.stdout, end="", flush=True)
        # Passing means this very test ran and passed, not that a filter matched nothing.
        if run.returncode == 0 and "test result: ok. 1 passed;" in run.stdout:
            print(f"[rerun] FLAKY: {test} failed in the full run and passed alone", flush=True)
        else:
            print(f"[rerun] FAILED again: {test}", flush=True)
            still_failing.append(test)
    return 1 if still_failing else 0


if __name__ == "__main__":
    sys.exit(main())
