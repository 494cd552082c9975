"""The `rollserve` command as a user runs it, in a child process, for the integration tests."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROLLSERVE = [sys.executable, "-m", "rollserve.cli.main"]


def run_rollserve(
    args: list[str], timeout: float = 540, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Runs ``rollserve ARGS`` to the end and returns it; fails the test with the end of its
    output if it exits with an error."""
    done = subprocess.run(
        [*ROLLSERVE, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done
