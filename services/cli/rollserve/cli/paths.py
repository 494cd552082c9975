"""Command-line paths checked before a command starts work.

A benchmark that runs for minutes and then cannot write its ``--json`` loses the run, so
every output path is checked when the flags are read: its folder is made if missing, and
a path that names a folder, or a folder nobody may write to, is refused with the reason.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def output_file(value: str) -> Path:
    """argparse ``type=`` for a file a command writes; makes its folder."""
    return _writable(value, is_dir=False)


def output_dir(value: str) -> Path:
    """argparse ``type=`` for a folder a command writes into; makes it."""
    return _writable(value, is_dir=True)


def _writable(value: str, *, is_dir: bool) -> Path:
    if not value.strip():
        raise argparse.ArgumentTypeError("an empty path")
    path = Path(value)
    if is_dir and path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{path} is a file, not a folder")
    if not is_dir and path.is_dir():
        raise argparse.ArgumentTypeError(f"{path} is a folder, not a file")
    folder = path if is_dir else path.parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot make the folder {folder}: {exc}") from exc
    if not os.access(folder, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"cannot write in {folder}")
    if not is_dir and path.exists() and not os.access(path, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot write {path}")
    return path
