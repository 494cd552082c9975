"""One scheduler per Redis database, between real scheduler processes (no engines needed).

Nothing is faked: the session's Redis (a database of each test's own) and scheduler processes.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import redis
from rollserve.cli.stack import ManagedProcess, StackError, free_port, wait_serving
from rollserve.scheduler.lease import LEASE_KEY

from tests.integration.scheduler_proc import start_scheduler

pytestmark = pytest.mark.integration

EXIT_WAIT_S = 60.0
# Long enough that no stall of a loaded machine loses a lease for want of a renewal.
LEASE_TTL_S = "30"
# A lease that outlives the test: its end is the test's to choose.
DEAD_LEASE_TTL_S = "600"


def lease_args(ttl_s: str) -> tuple[str, ...]:
    """A lease ttl, and a wait at start as long (the settings refuse a shorter one)."""
    return ("--lease-ttl-s", ttl_s, "--lease-wait-s", ttl_s)


def wait_exit(proc: ManagedProcess) -> int:
    deadline = time.monotonic() + EXIT_WAIT_S
    while proc.popen.poll() is None:
        assert time.monotonic() < deadline, f"{proc.name} did not exit:\n{proc.log_tail()}"
        time.sleep(0.1)
    return proc.popen.returncode


def wait_logged(proc: ManagedProcess, text: str) -> None:
    deadline = time.monotonic() + EXIT_WAIT_S
    while text not in proc.log_tail():
        assert proc.popen.poll() is None, f"{proc.name} exited:\n{proc.log_tail()}"
        assert time.monotonic() < deadline, f"{proc.name} never logged {text!r}"
        time.sleep(0.1)


def test_a_second_scheduler_on_the_database_exits_with_the_lease_error(
    other_redis_url: str, tmp_path: Path
) -> None:
    r = redis.Redis.from_url(other_redis_url)
    first = start_scheduler(other_redis_url, [], tmp_path, name="first")
    try:
        holder = r.get(LEASE_KEY)
        assert isinstance(holder, bytes)
        with pytest.raises(StackError, match="exited with code 1"):
            start_scheduler(other_redis_url, [], tmp_path, "--lease-wait-s", "0", name="second")
        log = (tmp_path / "second.log").read_text()
        assert f"another scheduler ({holder.decode()}) holds {LEASE_KEY}" in log
        assert "Traceback" not in log
        assert first.popen.poll() is None and r.get(LEASE_KEY) == holder  # untouched
    finally:
        first.stop()
    assert first.popen.returncode == 0
    assert r.get(LEASE_KEY) is None  # released at a clean stop: the next one starts at once
    third = start_scheduler(other_redis_url, [], tmp_path, "--lease-wait-s", "0", name="third")
    third.stop()


def test_a_killed_schedulers_lease_is_waited_out(other_redis_url: str, tmp_path: Path) -> None:
    r = redis.Redis.from_url(other_redis_url)
    first = start_scheduler(
        other_redis_url, [], tmp_path, *lease_args(DEAD_LEASE_TTL_S), name="first"
    )
    first.kill()  # no clean stop: its lease stays until its ttl ends
    dead = r.get(LEASE_KEY)
    assert isinstance(dead, bytes)
    # Started by hand: start_scheduler would wait for it to serve, which it must not yet do.
    port = free_port()
    argv = [sys.executable, "-m", "rollserve.scheduler", "--port", str(port)]
    argv += ["--redis-url", other_redis_url, "--lease-wait-s", DEAD_LEASE_TTL_S]
    second = ManagedProcess.start("second", argv, tmp_path)
    try:
        wait_logged(second, "waiting up to")
        assert r.get(LEASE_KEY) == dead
        r.delete(LEASE_KEY)  # as the end of its ttl would
        wait_serving(f"127.0.0.1:{port}", EXIT_WAIT_S, second)
        holder = r.get(LEASE_KEY)
        assert isinstance(holder, bytes) and f":{second.popen.pid}:" in holder.decode()
    finally:
        second.stop()


def test_a_scheduler_whose_lease_is_taken_exits_non_zero(
    other_redis_url: str, tmp_path: Path
) -> None:
    r = redis.Redis.from_url(other_redis_url)
    proc = start_scheduler(other_redis_url, [], tmp_path, *lease_args(LEASE_TTL_S))
    try:
        r.set(LEASE_KEY, "intruder")
        assert wait_exit(proc) == 1
    finally:
        proc.stop()
    log = proc.log_tail()
    assert "lost the scheduler lease" in log and "no longer held" in log
    assert "Traceback" not in log
    assert r.get(LEASE_KEY) == b"intruder"  # not its own: left alone
