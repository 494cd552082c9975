"""Scenarios that replay a trace, from the file to ``rollserve bench policies``, and the trace
``rollserve bench peer --trace`` records.

Nothing is faked: real scenario files and traces on disk, the simulator's engines and the
policies' own code; the peer's runs are built by hand (``test_bench_peer``'s builder), as the
benchmark records them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rich.console import Console
from rollserve.assets import reasoner_dir
from rollserve.bench.peer_stats import PromptStream, stream_trace
from rollserve.bench.policies import PoliciesConfig, run_policies
from rollserve.sim.scenarios import SimGroup, load_scenario, read_trace, write_trace

from tests.unit.test_bench_peer import run_of

HEAD = """
name = "replayed"
description = "a recorded workload"
profile = "gpu-h100-llama8b"
engines = 2
groups_per_step = 2
n = 3
max_tokens = 500
"""


def recorded(count: int, n: int = 3) -> list[SimGroup]:
    """``count`` groups; group i's samples have lengths 100 i + 1 … 100 i + n, the last cut
    at 900 so that the scenario's ``max_tokens`` (500) has something to cap."""
    return [
        SimGroup(
            key=f"g{i}",
            prompt_key=f"p{i % 3}",
            epoch=i // 3,
            prompt_len=20 + i,
            prefix_id="",
            prefix_len=0,
            max_tokens=0,
            output_lens=(*(100 * i + j for j in range(1, n)), 900),
        )
        for i in range(count)
    ]


def scenario_file(tmp_path: Path, body: str, groups: list[SimGroup]) -> Path:
    write_trace(groups, tmp_path / "trace.csv")
    path = tmp_path / "replayed.toml"
    path.write_text(HEAD + body)
    return path


def test_a_trace_scenario_replays_the_recorded_lengths(tmp_path: Path) -> None:
    path = scenario_file(tmp_path, 'trace = "trace.csv"\n', recorded(5))
    scenario = load_scenario(path)
    assert scenario.trace == (tmp_path / "trace.csv").resolve()
    assert scenario.steps == 2  # every complete step: the fifth group is left out
    steps = scenario.steps_of_groups()
    assert [[g.prompt_key for g in groups] for groups in steps] == [["p0", "p1"], ["p2", "p0"]]
    assert steps[1][1].epoch == 1
    assert steps[0][1].output_lens == (101, 102, 500)  # capped at the scenario's max_tokens
    assert steps[1][0].prompt_len == 22
    assert scenario.steps_of_groups() == steps


def test_a_trace_scenario_refuses_what_it_cannot_replay(tmp_path: Path) -> None:
    path = scenario_file(tmp_path, 'trace = "trace.csv"\nsteps = 3\n', recorded(5))
    with pytest.raises(ValueError, match=r"holds 2 complete step\(s\) of 2 groups and the run "):
        load_scenario(path).steps_of_groups()
    path = scenario_file(tmp_path, 'trace = "trace.csv"\nresponse_median = 9\n', recorded(4))
    with pytest.raises(ValueError, match=r"\['response_median'\] describe drawn lengths"):
        load_scenario(path)
    path = scenario_file(tmp_path, 'trace = "missing.csv"\n', recorded(4))
    with pytest.raises(ValueError, match=r"missing\.csv: no such file"):
        load_scenario(path)
    path = scenario_file(tmp_path, 'trace = "trace.csv"\n', recorded(4, n=4))
    with pytest.raises(ValueError, match="has 4 samples; the scenario's n is 3"):
        load_scenario(path).steps_of_groups()
    # Without a trace the drawn lengths' keys are still required.
    path = tmp_path / "drawn.toml"
    path.write_text(HEAD + "steps = 1\n")
    with pytest.raises(ValueError, match=r"missing keys \[.*'prompts'.*\]"):
        load_scenario(path)


def test_the_policies_bench_runs_on_a_trace(tmp_path: Path) -> None:
    path = scenario_file(tmp_path, 'trace = "trace.csv"\n', recorded(6))
    out = run_policies(
        PoliciesConfig(
            scenario=str(path),
            steps=2,  # after the one step the predictor sees first (--warm-steps)
            policies=("round_robin", "rl", "oracle"),
            out_dir=tmp_path / "out",
            json_path=tmp_path / "out.json",
        ),
        Console(file=open(tmp_path / "log.txt", "w"), width=190),  # noqa: SIM115
    )
    assert out["steps"] == 2
    assert out["length_max"] == 500
    rows = json.loads((tmp_path / "out.json").read_text())["policies"]
    assert set(rows) == {"round_robin", "rl", "oracle"}
    # Over-sampled runs need more of the trace than it holds: refused, with the numbers.
    with pytest.raises(ValueError, match="the run needs 6"):
        run_policies(
            PoliciesConfig(scenario=str(path), steps=2, oversample=0.5, policies=("round_robin",)),
            Console(file=open(tmp_path / "log2.txt", "w"), width=190),  # noqa: SIM115
        )


def test_the_peer_records_the_stream_as_a_trace(tmp_path: Path) -> None:
    stream = PromptStream(reasoner_dir(), None, seed=0)
    router = run_of("vllm-router", stream, {i: "answer 12" for i in range(2, 5)})
    # The over-sampled row delivered a group the router did not (5) and one after a gap (7),
    # and drew group 4 differently: the first run's lengths are kept.
    over = run_of("rollserve", stream, {4: "answer", 5: "answer 1", 7: "x"})
    groups = stream_trace([router, over], stream, start=2)
    assert [g.key for g in groups] == ["g2", "g3", "g4", "g5"]
    assert groups[2].output_lens == tuple(len(s.token_ids) for s in router.groups[2].samples)
    assert groups[3].output_lens == tuple(len(s.token_ids) for s in over.groups[1].samples)
    first = stream.group(2)
    assert groups[0].prompt_key == first.prompt_key
    assert groups[0].prompt_len == len(first.prompt_token_ids)
    assert groups[0].epoch == 0
    write_trace(groups, tmp_path / "peer.csv")
    (replayed,) = read_trace(tmp_path / "peer.csv", max_tokens=1024, groups_per_step=4)
    assert [g.output_lens for g in replayed] == [g.output_lens for g in groups]
