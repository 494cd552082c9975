"""The services' log lines (``rollserve.common.logs``): one line per record, whatever a
caller sent. Nothing faked."""

from __future__ import annotations

import logging
import sys

from rollserve.common.logs import OneLineFormatter, one_line


def test_a_message_is_one_line_and_a_traceback_keeps_its_lines() -> None:
    formatter = OneLineFormatter("%(levelname)s %(message)s")
    forged = "/x\n2026-12-08 00:00:00,000 scheduler CRITICAL forged\x00\u2028"
    record = logging.LogRecord("t", logging.INFO, __file__, 1, "loaded %s", (forged,), None)
    line = formatter.format(record)
    assert line == (
        "INFO loaded /x\\n2026-12-08 00:00:00,000 scheduler CRITICAL forged\\x00\\u2028"
    )
    try:
        try:
            raise KeyError("g\n2026-12-08 scheduler CRITICAL forged")
        except KeyError as exc:
            raise ValueError("a\nb") from exc
    except ValueError:
        failed = logging.LogRecord(
            "t", logging.ERROR, __file__, 1, "group %s failed", ("g\n1",), sys.exc_info()
        )
    lines = formatter.format(failed).splitlines()
    assert lines[0] == "ERROR group g\\n1 failed"
    assert lines[1] == "Traceback (most recent call last):" and len(lines) > 6
    # The lines that say the exceptions (the one raised and its cause) are one line each.
    assert "KeyError: 'g\\n2026-12-08 scheduler CRITICAL forged'" in lines
    assert lines[-1] == "ValueError: a\\nb"
    assert not any(line.startswith("2026-12-08") for line in lines)
    assert one_line("plain text, é ✓") == "plain text, é ✓"  # (printable: as it is)
