"""Log text for files and for `slipstream logs`: without terminal escapes (ANSI colours, cursor moves) and
with a carriage-return progress bar reduced to its last state, so a log reads the same in any viewer."""

from __future__ import annotations

import logging
import re

ANSI_RE = re.compile(
    r"\x1b\[[0-?]*[ -/]*[@-~]"  # CSI: colours, cursor moves, erase line
    r"|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)"  # OSC: window titles, hyperlinks
    r"|\x1b[@-Z\\-_]"  # other two-byte escapes
)


def plain(text: str) -> str:
    """`text` without ANSI escapes, and a progress bar that redraws itself with carriage returns
    (tqdm: `\\r 10%|# |\\r100%|##|`) reduced to its last state, after what preceded its first redraw on
    that line (a log record's time and level, Ray's `(Actor pid=N)` prefix). A CRLF ending is a newline."""
    text = ANSI_RE.sub("", text)
    if "\r" not in text:
        return text
    lines = []
    for line in text.split("\n"):
        parts = line.rstrip("\r").split("\r")
        lines.append(parts[0] + parts[-1] if len(parts) > 1 else parts[0])
    return "\n".join(lines)


class PlainFormatter(logging.Formatter):
    """A Formatter for log files: the formatted record (message, exception and all) through `plain`."""

    def format(self, record: logging.LogRecord) -> str:
        return plain(super().format(record))
