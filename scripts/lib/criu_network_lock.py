#!/usr/bin/env python3
"""Sets the network lock method CRIU recorded in a dump's inventory.img to its
default, iptables (scripts/bench-checkpoint, part 3's runc baseline).

Crab dumps a sandbox without TCP connections with `network-lock skip`, and CRIU keeps
that in inventory.img for the restore. A plain `runc checkpoint` records CRIU's default
(iptables): the baseline restores that. The file is a CRIU image: a magic, then one
protobuf message (inventory_entry) prefixed by its 4-byte little-endian size; field 11 is
network_lock_method, whose values skip (2) and iptables (0) are one byte each, so the
byte is rewritten in place. Exits non-zero when the field is absent or the file is not
such an image; leaves a file that already says iptables (or nftables) as it is.

Usage: criu_network_lock.py INVENTORY_IMG
"""

import argparse
import sys

NETWORK_LOCK_METHOD = 11
SKIP, IPTABLES = 2, 0


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("inventory", help="inventory.img of a CRIU dump (rewritten in place)")
    path = parser.parse_args().inventory
    with open(path, "rb") as f:
        data = bytearray(f.read())
    size = int.from_bytes(data[4:8], "little")
    at, end = 8, 8 + size

    def varint():
        nonlocal at
        value = shift = 0
        while True:
            byte = data[at]
            at += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                return value

    while at < end:
        key = varint()
        wire, field = key & 7, key >> 3
        if wire == 0:
            start = at
            value = varint()
            if field == NETWORK_LOCK_METHOD:
                if value == SKIP:
                    data[start] = IPTABLES
                    with open(path, "wb") as f:
                        f.write(data)
                return
        elif wire == 2:
            at += varint()
        elif wire == 1:
            at += 8
        elif wire == 5:
            at += 4
        else:
            sys.exit(f"{path}: unexpected wire type {wire}")
    sys.exit(f"{path}: no network_lock_method")


if __name__ == "__main__":
    main()
