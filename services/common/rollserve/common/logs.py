"""The services' log lines: one line per record, whatever a caller sent.

A log message that quotes what a caller gave (a weights path, a group id, an engine's error)
could hold a newline and start a line of its own: a forged ``CRITICAL`` line in the
scheduler's log, or a NUL that made it a binary file to grep. :class:`OneLineFormatter`
writes a message's characters that do not print as Python escapes them (``\\n``, ``\\x00``);
a traceback that follows the message keeps its lines, but the line that says each
exception is escaped so (an exception's text may quote a caller's too).
"""

from __future__ import annotations

import logging
import traceback
from types import TracebackType

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

    def formatException(
        self,
        ei: tuple[type[BaseException], BaseException, TracebackType | None]
        | tuple[None, None, None],
    ) -> str:
        if ei[1] is None:
            return super().formatException(ei)
        exc = traceback.TracebackException.from_exception(ei[1])
        said: set[str] = set()  # the lines that say an exception, of it and those it chains
        seen: set[int] = set()
        todo = [exc]
        while todo:
            one = todo.pop()
            if id(one) in seen:
                continue
            seen.add(id(one))
            said.update(one.format_exception_only())
            todo += [c for c in (one.__cause__, one.__context__) if c is not None]
        text = "".join(
            one_line(chunk[:-1]) + "\n" if chunk in said and chunk.endswith("\n") else chunk
            for chunk in exc.format()
        )
        return text[:-1] if text.endswith("\n") else text


def configure_logging(level: int | str, fmt: str) -> None:
    """The root logger writes ``fmt`` lines at ``level`` and above to stderr, one a record."""
    handler = logging.StreamHandler()
    handler.setFormatter(OneLineFormatter(fmt))
    logging.basicConfig(level=level, handlers=[handler])
