"""``rollserve up --sim``: the dev stack with simulated engines instead of vLLM (one
``rollserve sim fleet`` process), started as ``up`` starts it, and a group run through it
with the SDK. Nothing is faked: the engines are the product's simulated ones, the scheduler,
Redis (the embedded one) and the processes real."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from rollserve.assets import reasoner_dir
from rollserve.cli.stack import DevStack, StackConfig, StackError, free_port
from rollserve.client import GroupStatus, PromptGroup, RolloutClient, SamplingParams

ENGINES = 3


def test_a_stack_of_simulated_engines_serves_groups(tmp_path: Path) -> None:
    config = StackConfig(
        model=reasoner_dir(),
        engines=ENGINES,
        sim_profile="gpu-h100-llama8b",
        sim_time_scale=0.01,
        http_port=None,
        run_dir=tmp_path,
    )
    with DevStack(config) as stack:
        assert len(stack.sim_engines) == ENGINES and not stack.engines
        # no niceness beside simulated engines (no model threads to give way to); rl's cost
        # model is theirs
        assert stack.scheduler is not None
        args = list(stack.scheduler.popen.args)  # type: ignore[arg-type]
        assert args[args.index("--nice") + 1] == "0"
        assert args[args.index("--cost-profile") + 1] == "gpu-h100-llama8b"
        rows = dict(stack.describe())
        assert rows["engines"].startswith(f"{ENGINES} SIMULATED (gpu-h100-llama8b")
        with RolloutClient(stack.scheduler_address, stack.redis_url, "sim-stack") as client:
            groups = [
                PromptGroup(
                    group_id=f"g{i}",
                    prompt_text="12+7=",
                    n=4,
                    sampling=SamplingParams(max_tokens=32),
                )
                for i in range(6)
            ]
            client.submit(groups)
            received = list(client.groups(limit=6, timeout_s=120))
            for item in received:
                item.done()
            engines = {e.engine_id for e in client.status().engines}
        assert engines == set(stack.sim_engines)
        assert len(stack.pids()) == 3  # the fleet, the scheduler, Redis
    assert {r.result.group_id for r in received} == {f"g{i}" for i in range(6)}
    assert all(r.result.status is GroupStatus.DELIVERED for r in received)


def test_a_profile_that_is_not_there_stops_the_stack_naming_it(tmp_path: Path) -> None:
    config = StackConfig(
        model=reasoner_dir(), engines=1, sim_profile="no-such-profile", run_dir=tmp_path
    )
    with pytest.raises(StackError, match="no-such-profile"), DevStack(config):
        pass


def test_vllm_flags_are_refused_for_simulated_engines(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="simulated engines take no vLLM flags"):
        StackConfig(model=tmp_path, sim_profile="cpu-tiny", engine_args=("--seed=1",))


class Up:
    """``rollserve up --sim`` as a child process, its output read line by line."""

    def __init__(self, tmp_path: Path, *flags: str) -> None:
        self.port = free_port()
        self.popen = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import sys; from rollserve.cli.main import main; sys.exit(main())",
                "up",
                "--sim",
                "--engines",
                "1",
                "--sim-time-scale",
                "0.01",
                "--scheduler-port",
                str(self.port),
                "--run-dir",
                str(tmp_path),
                *flags,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []

    def read_until(self, start: str) -> str:
        """Reads lines up to one that starts with ``start``."""
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            self.lines.append(line)
            if line.startswith(start):
                return line
        pytest.fail(f"`up` said no line {start!r}: {''.join(self.lines)}")

    def child(self, module: str) -> psutil.Process:
        (found,) = (p for p in psutil.Process(self.popen.pid).children() if module in p.cmdline())
        return found

    def close(self) -> None:
        if self.popen.poll() is None:  # (the test failed: leave nothing of the stack running)
            for child in psutil.Process(self.popen.pid).children(recursive=True):
                child.kill()
            self.popen.kill()
            self.popen.wait()


def test_up_stops_the_stack_when_one_of_its_processes_exits(tmp_path: Path) -> None:
    """With ``--max-restarts 0``, `rollserve up` does not serve on without its scheduler:
    it names the process, shows its log's tail, stops the rest and exits 1."""
    up = Up(tmp_path, "--max-restarts", "0")
    try:
        up.read_until("ready")
        scheduler = up.child("rollserve.scheduler")
        others = [p for p in psutil.Process(up.popen.pid).children() if p.pid != scheduler.pid]
        scheduler.kill()
        rest, _ = up.popen.communicate(timeout=60)
    finally:
        up.close()
    assert up.popen.returncode == 1, rest
    assert "scheduler exited with code -9; stopping everything (--max-restarts 0" in rest, rest
    _, alive = psutil.wait_procs(others, timeout=30)
    assert not alive, alive


def test_up_starts_again_what_exits_and_the_groups_arrive_once(tmp_path: Path) -> None:
    """`rollserve up` starts again a scheduler killed while groups run (the new one takes
    them over from Redis once the old one's lease ends) and simulated engines that die (and
    the scheduler with their new addresses): every group arrives once. A process that keeps
    exiting stops the stack."""
    up = Up(tmp_path, "--max-restarts", "2", "--scheduler-arg=--lease-ttl-s=1")
    try:
        up.read_until("ready")
        redis_url = next(line.split()[1] for line in up.lines if line.split()[:1] == ["redis"])
        address = f"127.0.0.1:{up.port}"
        with RolloutClient(address, redis_url, "restarts", rpc_timeout_s=5.0) as client:
            client.submit(_groups("a", 8))
            up.child("rollserve.scheduler").kill()
            up.read_until("scheduler started again")
            up.child("rollserve.sim").kill()
            up.read_until("sim-fleet started again")
            client.submit(_groups("b", 4))
            received = list(client.groups(limit=12, timeout_s=120))
            for item in received:
                item.done()
        for _ in range(3):  # a crash loop: the third exit in a row stops everything
            up.child("rollserve.scheduler").kill()
            if "stopping everything" in up.read_until("scheduler exited"):
                break
            up.read_until("scheduler started again")
        rest, _ = up.popen.communicate(timeout=90)
    finally:
        up.close()
    ids = sorted(r.result.group_id for r in received)
    assert ids == sorted([f"a{i}" for i in range(8)] + [f"b{i}" for i in range(4)])
    assert all(r.result.status is GroupStatus.DELIVERED for r in received)
    said = "".join(up.lines) + rest
    assert "scheduler exited with code -9 after 2 restarts in a row; stopping everything" in said
    assert up.popen.returncode == 1, said


def _groups(prefix: str, count: int) -> list[PromptGroup]:
    return [
        PromptGroup(
            group_id=f"{prefix}{i}",
            prompt_text="12+7=",
            n=2,
            sampling=SamplingParams(max_tokens=256),
        )
        for i in range(count)
    ]
