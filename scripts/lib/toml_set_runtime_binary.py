#!/usr/bin/env python3
"""Prints a crab config (crab.toml) with [runtime] binary set to BINARY.

Usage: toml_set_runtime_binary.py CONFIG BINARY
  CONFIG may be missing: the output is then a config with only that key.
"""

import sys


def main():
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    path, binary = sys.argv[1], sys.argv[2]
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        lines = []
    out, section, placed = [], None, False
    for line in lines:
        stripped = line.strip()
        if stripped.startswith("[") and stripped.endswith("]"):
            if section == "runtime" and not placed:
                out.append(f'binary = "{binary}"')
                placed = True
            section = stripped[1:-1].strip()
        elif section == "runtime" and stripped.split("=")[0].strip() == "binary":
            continue
        out.append(line)
    if section == "runtime" and not placed:
        out.append(f'binary = "{binary}"')
        placed = True
    if not placed:
        out += ["[runtime]", f'binary = "{binary}"']
    print("\n".join(out))


if __name__ == "__main__":
    main()
