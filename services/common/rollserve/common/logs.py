"""The services' log lines: one line per record, whatever a caller sent.

A log message that quotes what a caller gave (a weights path, a group id, an engine's error)
could hold a newline and start a line of its own: a forged ``CRITICAL`` line in the
scheduler's log, or a NUL that made it a binary file to grep. :class:`OneLineFormatter`
writes a message's characters that do not print as Python escapes them (``\\n``, ``\\x00``);
a traceback that follows the message keeps its lines.
"""

from __future__ import annotations

import logging

__all__ = ["OneLineFormatter", "configure_logging", "one_line"]


def one_line(text: str) -> str:
    """``text`` with each character that does not print escaped as in a Python literal."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


class OneLineFormatter(logging.Formatter):
    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = one_line(record.message)
        return super().formatMessage(record)


def configure_logging(level: int | str, fmt: str) -> None:
    """The root logger writes ``fmt`` lines at ``level`` and above to stderr, one a record."""
    handler = logging.StreamHandler()
    handler.setFormatter(OneLineFormatter(fmt))
    logging.basicConfig(level=level, handlers=[handler])
