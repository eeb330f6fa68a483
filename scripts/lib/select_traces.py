#!/usr/bin/env python3
"""Picks COUNT dev traces for scripts/bench-node and writes them, cut to their first TURNS
turns, into DEST (the header's turn count follows the cut); prints the written paths.

Traces that start servers or leave processes behind (nginx, jupyter, model servers: their
turns are CRIU dumps) come first, then the rest by name. Exits non-zero when SRC holds
fewer than COUNT traces.

Usage: select_traces.py SRC COUNT DEST TURNS
"""

import argparse
import json
import pathlib
import sys

# Traces that start servers or leave processes behind give proc turns (CRIU dumps).
PROCISH = ("nginx", "jupyter", "hf-model-inference", "decommissioning", "fasttext")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src", type=pathlib.Path, help="directory of *.jsonl traces")
    parser.add_argument("count", type=int, help="how many traces")
    parser.add_argument("dest", type=pathlib.Path, help="where the cut traces go (made if absent)")
    parser.add_argument("turns", type=int, help="turns kept per trace")
    a = parser.parse_args()
    files = sorted(a.src.glob("*.jsonl"))
    files.sort(key=lambda f: (not any(p in f.name for p in PROCISH), f.name))
    if len(files) < a.count:
        sys.exit(f"only {len(files)} traces in {a.src}, {a.count} wanted")
    a.dest.mkdir(parents=True, exist_ok=True)
    for f in files[:a.count]:
        lines = f.read_text().splitlines()
        header = json.loads(lines[0])
        kept = [line for line in lines[1:] if line.strip()][:a.turns]
        header["turns"] = len(kept)
        (a.dest / f.name).write_text("\n".join([json.dumps(header)] + kept) + "\n")
        print(a.dest / f.name)


if __name__ == "__main__":
    main()
