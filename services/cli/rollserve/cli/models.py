"""Where the CLI keeps models it makes, and making them on demand."""

from __future__ import annotations

import os
from pathlib import Path

from rich.console import Console

TINY_MODEL_NAME = "tiny-llama"


def cache_dir() -> Path:
    """``$ROLLSERVE_HOME``, else ``~/.cache/rollserve``."""
    root = os.environ.get("ROLLSERVE_HOME")
    return Path(root) if root else Path.home() / ".cache" / "rollserve"


def default_model_dir() -> Path:
    return cache_dir() / "models" / TINY_MODEL_NAME


def ensure_tiny_model(path: Path, console: Console | None = None) -> Path:
    from rollserve.engine.tiny_model import make_tiny_model

    if console is not None:
        console.print(f"model: {path}")
    return make_tiny_model(path)
