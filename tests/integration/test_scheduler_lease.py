"""One scheduler per Redis database, between real scheduler processes (no engines needed).

Nothing is faked: the session's Redis (a database of each test's own) and scheduler processes.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import redis
from rollserve.cli.stack import ManagedProcess, StackError
from rollserve.scheduler.lease import LEASE_KEY

from tests.integration.scheduler_proc import start_scheduler

pytestmark = pytest.mark.integration

EXIT_WAIT_S = 60.0


def wait_exit(proc: ManagedProcess) -> int:
    deadline = time.monotonic() + EXIT_WAIT_S
    while proc.popen.poll() is None:
        assert time.monotonic() < deadline, f"{proc.name} did not exit:\n{proc.log_tail()}"
        time.sleep(0.1)
    return proc.popen.returncode


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
    first = start_scheduler(other_redis_url, [], tmp_path, "--lease-ttl-s", "2", name="first")
    first.kill()  # no clean stop: its lease stays until its ttl ends
    second = start_scheduler(other_redis_url, [], tmp_path, name="second")  # waits up to 15 s
    second.stop()
    assert "waiting up to" in (tmp_path / "second.log").read_text()


def test_a_scheduler_whose_lease_is_taken_exits_non_zero(
    other_redis_url: str, tmp_path: Path
) -> None:
    r = redis.Redis.from_url(other_redis_url)
    proc = start_scheduler(other_redis_url, [], tmp_path, "--lease-ttl-s", "3")
    try:
        r.set(LEASE_KEY, "intruder")
        assert wait_exit(proc) == 1
    finally:
        proc.stop()
    log = proc.log_tail()
    assert "lost the scheduler lease" in log and "no longer held" in log
    assert "Traceback" not in log
    assert r.get(LEASE_KEY) == b"intruder"  # not its own: left alone
