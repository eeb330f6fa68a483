"""Reads crab shim log lines as containerd's log holds them: the shim's `tracing`
lines, copied raw from its log fifo, `<RFC 3339 UTC time> <LEVEL> <message> key=value ...`.

Benchmarks select lines and read figures by these fields (`container`, `restore_step`,
`waited_us`, ...), never by the message text, which is prose for people and may change.
A module for the scripts beside it; standard library only.
"""

import re
from datetime import datetime, timezone

_STAMP = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)\.(\d+)Z\s+([A-Z]+)\s")
# key=value or key="quoted \"value\"", as tracing-subscriber's fmt layer writes fields.
_FIELD = re.compile(r'(?:^|\s)([A-Za-z_][A-Za-z0-9_.]*)=("(?:[^"\\]|\\.)*"|\S+)')


class Line:
    """One shim log line: its time (ns since the epoch), level and fields."""

    __slots__ = ("ns", "level", "fields")

    def __init__(self, ns, level, fields):
        self.ns, self.level, self.fields = ns, level, fields

    def number(self, name, default=0.0):
        """A numeric field, `default` when the line lacks it."""
        try:
            return float(self.fields[name])
        except (KeyError, ValueError):
            return default

    def is_container(self, container):
        """Whether the line is about `container` (an id, or `<namespace>/<id>` as store keys print)."""
        value = self.fields.get("container")
        return value is not None and (value == container or value.endswith("/" + container))


def _unquote(value):
    if len(value) >= 2 and value[0] == value[-1] == '"':
        return re.sub(r"\\(.)", r"\1", value[1:-1])
    return value


def parse(text):
    """The Line of a shim log line, or None for any other line (containerd's own)."""
    m = _STAMP.match(text)
    if not m:
        return None
    whole = datetime.strptime(m[1], "%Y-%m-%dT%H:%M:%S").replace(tzinfo=timezone.utc)
    ns = int(whole.timestamp()) * 10**9 + int(m[2].ljust(9, "0")[:9])
    fields = {key: _unquote(value) for key, value in _FIELD.findall(text[m.end():])}
    return Line(ns, m[3], fields)


def lines(path):
    """The shim lines of a log file, in order."""
    with open(path, errors="replace") as f:
        for text in f:
            line = parse(text.rstrip("\n"))
            if line is not None:
                yield line
