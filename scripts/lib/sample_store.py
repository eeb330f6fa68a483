#!/usr/bin/env python3
"""Samples the checkpoint store for scripts/bench-node until STOPFILE exists.

Every 0.25 s, one line into OUTFILE: "seconds store_bytes device_written_bytes", where
store_bytes is the sum of the sizes of the store's distinct files (by inode: a file renamed
from tmp/ into blobs/ during the walk is counted once) and device_written_bytes the bytes
written to the state dir's block device (/sys/dev/block/M:m/stat), -1 unless that device is
the store's own (a file system whose mount point holds the state dir and nothing else).
Every second (and once at the end), crabd's status (`crabctl node --json`) as one line of
JSON into STATUSFILE.

Usage: sample_store.py STATE_DIR STOPFILE OUTFILE STATUSFILE CRABCTL
"""

import argparse
import os
import subprocess
import time


def size(path):
    seen, total = set(), 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except FileNotFoundError:
                continue
            if st.st_ino not in seen:
                seen.add(st.st_ino)
                total += st.st_size
    return total


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("root", help="crab's state dir (the checkpoint store)")
    parser.add_argument("stop", help="sampling ends once this file exists")
    parser.add_argument("out", help="store samples, one line each")
    parser.add_argument("status_out", help="crabd status samples, one JSON per line")
    parser.add_argument("crabctl", help="the crabctl binary")
    a = parser.parse_args()
    dev = os.stat(a.root).st_dev
    stat_path = f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat"
    # The device counts only when it is a file system of the store's own: its
    # mount point holds the state dir and nothing else.
    mount_point = os.path.dirname(os.path.abspath(a.root))
    own_device = (
        os.path.exists(stat_path)
        and os.path.ismount(mount_point)
        and mount_point != "/"
        and os.stat(mount_point).st_dev == dev
        and set(os.listdir(mount_point)) <= {os.path.basename(a.root), "lost+found"}
    )

    def device_written():
        if not own_device:
            return -1
        with open(stat_path) as f:
            return int(f.read().split()[6]) * 512

    start = time.monotonic()
    last_status = -1.0
    with open(a.out, "w") as f, open(a.status_out, "w") as g:
        while True:
            done = os.path.exists(a.stop)
            now = time.monotonic() - start
            f.write(f"{now:.3f} {size(a.root)} {device_written()}\n")
            f.flush()
            if now - last_status >= 1.0 or done:
                last_status = now
                got = subprocess.run([a.crabctl, "node", "--json"], capture_output=True, text=True)
                if got.returncode == 0:
                    g.write(got.stdout.replace("\n", " ") + "\n")
            if done:
                break
            time.sleep(0.25)


if __name__ == "__main__":
    main()
