#!/usr/bin/env python3
"""Times a plain `runc restore` of CRIU images into an existing bundle
(scripts/bench-checkpoint, part 3's baseline), prints the nanoseconds it took, then kills
and deletes the restored container.

The bundle's spec loses the CRIU config annotation (the crab shim's action script) first:
this is runc alone. The restored process gets fresh pipes for its stdio, as the dump had;
it keeps their write ends, so runc's output is read only when runc failed. Exits non-zero
when runc restore fails or the container is not running after it.

Usage: runc_restore.py WORK BUNDLE IMAGES
  WORK    scratch directory: runc's root (WORK/runc-root) and CRIU's work dir
  BUNDLE  the container's bundle (config.json, its rootfs still mounted)
  IMAGES  the CRIU image directory to restore from
"""

import argparse
import json
import os
import subprocess
import sys
import time

CONTAINER = "bench-runc-restored"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("work")
    parser.add_argument("bundle")
    parser.add_argument("images")
    args = parser.parse_args()
    root = f"{args.work}/runc-root"
    # Plain runc: without the CRIU config (action script) the crab shim named in the spec.
    spec_path = f"{args.bundle}/config.json"
    with open(spec_path) as f:
        spec = json.load(f)
    spec.get("annotations", {}).pop("org.criu.config", None)
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    pipes = [os.pipe() for _ in range(3)]
    start = time.monotonic_ns()
    p = subprocess.Popen(["runc", "--root", root, "restore", "-d", "--file-locks", "--tcp-established",
                          "--ext-unix-sk", "--image-path", args.images, "--work-path", f"{args.work}/runc-restore-work",
                          "--bundle", args.bundle, CONTAINER],
                         stdin=pipes[0][0], stdout=pipes[1][1], stderr=pipes[2][1])
    p.wait()
    took = time.monotonic_ns() - start
    for _, w in pipes:
        os.close(w)
    if p.returncode != 0:
        sys.exit("runc restore failed: " + os.read(pipes[2][0], 65536).decode(errors="replace"))
    state = subprocess.run(["runc", "--root", root, "state", CONTAINER], capture_output=True, text=True)
    if '"running"' not in state.stdout:
        sys.exit(f"runc restore: not running: {state.stdout}")
    subprocess.run(["runc", "--root", root, "kill", CONTAINER, "KILL"])
    for _ in range(50):
        time.sleep(0.1)
        if subprocess.run(["runc", "--root", root, "delete", "-f", CONTAINER], stderr=subprocess.DEVNULL).returncode == 0:
            break
    print(took)


if __name__ == "__main__":
    main()
