#!/usr/bin/env python3
"""Times a shell command REPS times for scripts/bench-inspector-tax, inside whatever runs it (the
host, a container): one "wall user sys" line (seconds) per run on stderr. User and system time
are the kernel's accounting of the command and every process it waited for (wait4).

Usage: bench_inspector_tax_time.py REPS COMMAND
"""

import os
import sys
import time


def main():
    if len(sys.argv) != 3 or not sys.argv[1].isdigit():
        raise SystemExit(__doc__)
    reps, command = int(sys.argv[1]), sys.argv[2]
    for _ in range(reps):
        start = time.monotonic()
        pid = os.fork()
        if pid == 0:
            null = os.open(os.devnull, os.O_RDWR)
            os.dup2(null, 1)
            os.dup2(null, 2)
            os.execvp("bash", ["bash", "-c", command])
        _, _, usage = os.wait4(pid, 0)
        wall = time.monotonic() - start
        print(f"{wall:.4f} {usage.ru_utime:.4f} {usage.ru_stime:.4f}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
