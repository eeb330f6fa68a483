#!/usr/bin/env python3
"""Source distributions for the code-repair images (scripts/lib/images.sh).

  sdist.py test-extra SDIST   prints the extra that carries the project's test
                              dependencies (tests, test or testing, the first declared),
                              read from the sdist's metadata (PKG-INFO Provides-Extra, or an
                              egg-info requires.txt section); prints nothing when it has none
  sdist.py unpack SDIST DEST  unpacks the sdist and moves its contents (under its single
                              top-level directory, if it has one) into DEST

SDIST is a .tar.gz (or other tar) or .zip archive. Standard library only: runs wherever
python3 does.
"""

import argparse
import os
import re
import shutil
import tarfile
import tempfile
import zipfile

TEST_EXTRAS = ("tests", "test", "testing")


def test_extra(path):
    if zipfile.is_zipfile(path):
        archive = zipfile.ZipFile(path)
        names = archive.namelist()

        def read(name):
            return archive.read(name).decode("utf-8", "replace")
    else:
        archive = tarfile.open(path)
        names = archive.getnames()

        def read(name):
            return archive.extractfile(name).read().decode("utf-8", "replace")
    extras = set()
    for name in names:
        parts = name.split("/")
        if parts[-1] == "PKG-INFO" and len(parts) <= 3:
            extras.update(re.findall(r"^Provides-Extra:\s*(\S+)", read(name), re.M))
        elif parts[-1] == "requires.txt" and parts[-2].endswith(".egg-info"):
            extras.update(m.split(":")[0] for m in re.findall(r"^\[([^\]]+)\]", read(name), re.M))
    return next((candidate for candidate in TEST_EXTRAS if candidate in extras), None)


def unpack(sdist, dest):
    with tempfile.TemporaryDirectory() as tmp:
        shutil.unpack_archive(sdist, tmp)
        entries = os.listdir(tmp)
        single = len(entries) == 1 and os.path.isdir(os.path.join(tmp, entries[0]))
        top = os.path.join(tmp, entries[0]) if single else tmp
        for name in os.listdir(top):
            shutil.move(os.path.join(top, name), dest)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    extra = commands.add_parser("test-extra", help="print the sdist's test extra, if any")
    extra.add_argument("sdist")
    unpacking = commands.add_parser("unpack", help="unpack the sdist's contents into DEST")
    unpacking.add_argument("sdist")
    unpacking.add_argument("dest")
    a = parser.parse_args()
    if a.command == "test-extra":
        found = test_extra(a.sdist)
        if found:
            print(found)
    else:
        unpack(a.sdist, a.dest)


if __name__ == "__main__":
    main()
