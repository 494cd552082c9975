"""Output paths are checked when the flags are read, before a command starts its work."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from rollserve.cli.paths import output_dir, output_file


def test_an_output_file_in_a_missing_folder_gets_the_folder(tmp_path: Path) -> None:
    path = output_file(str(tmp_path / "a" / "b" / "run.json"))
    assert path == tmp_path / "a" / "b" / "run.json"
    assert (tmp_path / "a" / "b").is_dir()
    assert not path.exists()


def test_an_output_folder_is_made(tmp_path: Path) -> None:
    assert output_dir(str(tmp_path / "pngs")).is_dir()


@pytest.mark.parametrize(
    ("make", "check", "message"),
    [
        (lambda p: p.mkdir(), output_file, "is a folder, not a file"),
        (lambda p: p.write_text(""), output_dir, "is a file, not a folder"),
        (lambda p: None, lambda v: output_file(""), "an empty path"),
    ],
)
def test_a_path_of_the_wrong_kind_is_refused(tmp_path, make, check, message) -> None:  # type: ignore[no-untyped-def]
    target = tmp_path / "x"
    make(target)
    with pytest.raises(Exception, match=message):
        check(str(target))


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_a_folder_nobody_may_write_in_is_refused(tmp_path: Path) -> None:
    tmp_path.chmod(0o500)
    try:
        with pytest.raises(Exception, match="cannot"):
            output_file(str(tmp_path / "sub" / "run.json"))
    finally:
        tmp_path.chmod(0o700)


def test_a_benchmark_refuses_a_bad_json_path_before_it_runs(tmp_path: Path) -> None:
    """The flag names the problem at once (it used to fail after the whole run)."""
    proc = subprocess.run(
        [sys.executable, "-m", "rollserve.cli.main", "bench", "bound", "--json", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2
    assert f"argument --json: {tmp_path} is a folder, not a file" in proc.stderr
