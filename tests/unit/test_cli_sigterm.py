"""A SIGTERM to a ``rollserve`` command unwinds it as Ctrl-C does, so what it started stops.

Faked: the command (a parser whose one command starts a ``sleep`` child inside a context
manager that stops it, then waits); real: ``rollserve.cli.main.main`` and its handler."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import argparse, contextlib, subprocess, sys, time
    import rollserve.cli.main as cli

    def command(args):
        child = subprocess.Popen(["sleep", "120"], stdout=subprocess.DEVNULL)
        try:
            print(child.pid, flush=True)
            time.sleep(120)
        finally:
            child.kill()
            child.wait()
            print("stopped the child", flush=True)
        return 0

    def parser():
        p = argparse.ArgumentParser()
        p.set_defaults(func=command)
        return p

    cli.build_parser = parser
    try:
        sys.exit(cli.main([]))
    except KeyboardInterrupt:
        sys.exit(130)
    """
)


def test_sigterm_stops_what_the_command_started() -> None:
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    child = int(proc.stdout.readline())
    try:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        assert "stopped the child" in out
        assert proc.returncode == 130
        assert not alive(child)
    finally:
        if alive(child):
            os.kill(child, signal.SIGKILL)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
