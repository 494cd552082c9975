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
from rollserve.cli.stack import DevStack, StackConfig, StackError
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


def test_up_stops_the_stack_when_one_of_its_processes_exits(tmp_path: Path) -> None:
    """`rollserve up` does not serve on without its scheduler (one that lost its lease
    exits): it names the process, shows its log's tail, stops the rest and exits 1."""
    up = subprocess.Popen(
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
            "--run-dir",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert up.stdout is not None
        lines = []
        for line in up.stdout:
            lines.append(line)
            if line.startswith("ready"):
                break
        else:
            pytest.fail(f"`up` did not get ready: {''.join(lines)}")
        (scheduler,) = (
            p for p in psutil.Process(up.pid).children() if "rollserve.scheduler" in p.cmdline()
        )
        others = [p for p in psutil.Process(up.pid).children() if p.pid != scheduler.pid]
        scheduler.kill()
        rest, _ = up.communicate(timeout=60)
    finally:
        if up.poll() is None:  # (the test failed: leave nothing of the stack running)
            for child in psutil.Process(up.pid).children(recursive=True):
                child.kill()
            up.kill()
    assert up.returncode == 1, rest
    assert "scheduler exited with code -9; stopping everything" in rest, rest
    _, alive = psutil.wait_procs(others, timeout=30)
    assert not alive, alive
