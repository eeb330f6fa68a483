#!/usr/bin/env python3
"""The package sources replay sandboxes install from without a network.

  packages.py scan TRACE...        the PyPI requirements and Debian packages the traces' turns
                                   install, as JSON {"pip": [...], "apt": [...]}, sorted
  packages.py index FILES SIMPLE   writes a PEP 503 index of the distribution files in FILES
                                   under SIMPLE (one index.html per project, links relative)

The scan reads each turn's command the way a shell would split it (on ; & | and newlines,
then words), and keeps the arguments of `pip install` / `apt-get install` that name packages:
options, their values, local paths and URLs are left out.
"""

import hashlib
import html
import json
import os
import re
import shlex
import sys

PIP_OPTIONS_WITH_VALUE = {
    "-r", "--requirement", "-c", "--constraint", "-i", "--index-url", "--extra-index-url", "-f",
    "--find-links", "-t", "--target", "--prefix", "--root", "--platform", "--python-version",
    "--implementation", "--abi", "--src", "--upgrade-strategy", "--progress-bar", "--log",
    "--timeout", "--retries", "--cache-dir", "--trusted-host", "--cert", "--client-cert",
    "--proxy", "--only-binary", "--no-binary", "--report", "--config-settings", "-C",
    "--global-option", "--install-option", "--python",
}
APT_OPTIONS_WITH_VALUE = {"-o", "--option", "-c", "--config-file", "-t", "--target-release"}


def segments(cmd):
    """Simple commands of a shell command line, as lists of words (best effort: a line the
    shell could not split is skipped)."""
    for part in re.split(r"\n|;|&&|\|\||\||&", cmd):
        try:
            words = shlex.split(part, comments=True)
        except ValueError:
            continue
        # Redirections are no arguments.
        words = [w for w in words if not re.match(r"^\d*[<>]", w)]
        while words and ("=" in words[0] and not words[0].startswith("-")):
            words = words[1:]  # VAR=value prefixes
        while words and words[0] in ("sudo", "timeout", "env", "nohup", "time"):
            words = words[1:]
            while words and (re.match(r"^\d+[smh]?$", words[0]) or words[0].startswith("-")):
                words = words[1:]
        if words:
            yield words


def pip_args(words):
    """The words after `install` when `words` is a pip install, else None."""
    if not words:
        return None
    head = os.path.basename(words[0])
    if re.match(r"^pip3?(\.\d+)?$", head):
        rest = words[1:]
    elif re.match(r"^python3?(\.\d+)?$", head) and words[1:3] == ["-m", "pip"]:
        rest = words[3:]
    else:
        return None
    if not rest or rest[0] != "install":
        return None
    return rest[1:]


def pip_requirements(args):
    out, skip = [], False
    for word in args:
        if skip:
            skip = False
            continue
        if word in PIP_OPTIONS_WITH_VALUE:
            skip = True
            continue
        if word in ("-e", "--editable"):
            skip = True
            continue
        if word.startswith("-") or "/" in word or word.startswith(".") or "://" in word:
            continue
        if not re.match(r"^[A-Za-z0-9][A-Za-z0-9._\-\[\],<>=!~*+ ]*$", word):
            continue
        out.append(word)
    return out


def apt_packages(words):
    if not words or os.path.basename(words[0]) not in ("apt", "apt-get"):
        return None
    rest, out, skip, command = words[1:], [], False, None
    for word in rest:
        if skip:
            skip = False
            continue
        if word in APT_OPTIONS_WITH_VALUE:
            skip = True
            continue
        if word.startswith("-"):
            continue
        if command is None:
            command = word
            if command != "install":
                return None
            continue
        if re.match(r"^[a-z0-9][a-z0-9+.\-]*(=[A-Za-z0-9.+:~\-]+)?$", word):
            out.append(word)
    return out if command == "install" else None


def scan(paths):
    pip, apt = set(), set()
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    cmd = json.loads(line).get("cmd")
                except json.JSONDecodeError:
                    continue
                if not isinstance(cmd, str):
                    continue
                for words in segments(cmd):
                    args = pip_args(words)
                    if args is not None:
                        pip.update(pip_requirements(args))
                        continue
                    packages = apt_packages(words)
                    if packages:
                        apt.update(packages)
    json.dump({"pip": sorted(pip), "apt": sorted(apt)}, sys.stdout, indent=1)
    print()


def normalize(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def project_of(filename):
    """The project name of a wheel or sdist file name."""
    if filename.endswith(".whl"):
        return filename.split("-")[0]
    for ext in (".tar.gz", ".zip", ".tar.bz2", ".tgz"):
        if filename.endswith(ext):
            return filename[: -len(ext)].rsplit("-", 1)[0]
    return None


def index(files_dir, simple_dir):
    projects = {}
    for name in sorted(os.listdir(files_dir)):
        project = project_of(name)
        if project:
            projects.setdefault(normalize(project), []).append(name)
    os.makedirs(simple_dir, exist_ok=True)
    rel_files = os.path.relpath(files_dir, simple_dir)
    with open(os.path.join(simple_dir, "index.html"), "w", encoding="utf-8") as top:
        top.write("<!DOCTYPE html>\n<html><body>\n")
        for project in sorted(projects):
            top.write(f'<a href="{project}/">{html.escape(project)}</a>\n')
        top.write("</body></html>\n")
    for project, names in projects.items():
        pdir = os.path.join(simple_dir, project)
        os.makedirs(pdir, exist_ok=True)
        with open(os.path.join(pdir, "index.html"), "w", encoding="utf-8") as page:
            page.write("<!DOCTYPE html>\n<html><body>\n")
            for name in names:
                with open(os.path.join(files_dir, name), "rb") as data:
                    digest = hashlib.sha256(data.read()).hexdigest()
                href = f"../{rel_files}/{name}#sha256={digest}"
                page.write(f'<a href="{html.escape(href)}">{html.escape(name)}</a>\n')
            page.write("</body></html>\n")
    print(f"{len(projects)} projects")


def main(argv):
    if len(argv) >= 2 and argv[1] == "scan":
        scan(argv[2:])
    elif len(argv) == 4 and argv[1] == "index":
        index(argv[2], argv[3])
    else:
        sys.stderr.write(__doc__)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
