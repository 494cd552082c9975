"""``rollserve bench fleet``'s flags and table (the rows themselves need processes: run the
command; nothing here starts one)."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
from rich.console import Console
from rollserve.bench.fleet import FleetConfig, FleetRow, _table, run_fleet
from rollserve.cli.sim import _policies


def row(policy: str, engines: int, groups_per_s: float) -> FleetRow:
    values: dict[str, object] = {f.name: 1.0 for f in dataclasses.fields(FleetRow)}
    values.update(
        policy=policy,
        engines=engines,
        groups=engines * 4,
        groups_per_simulated_s=groups_per_s,
        fleet_kept_up=True,
        sample_lead_simulated_s=None,
    )
    return FleetRow(**values)  # type: ignore[arg-type]


def rendered(rows: list[FleetRow]) -> str:
    console = Console(width=400, record=True)
    console.print(_table(rows, "gpu"))
    return console.export_text()


def test_policies_are_compared_at_each_fleet_size_and_scaled_within_their_own() -> None:
    lo = "least_outstanding"
    text = rendered([row("rl", 8, 10.0), row(lo, 8, 12.5), row("rl", 64, 60.0), row(lo, 64, 50.0)])
    lines = {tuple(line.split("│")[1:3]): line for line in text.splitlines() if "│" in line}

    def cells(engines: str, policy: str) -> list[str]:
        line = next(
            v for k, v in lines.items() if k[0].strip() == engines and k[1].strip() == policy
        )
        return [c.strip() for c in line.split("│")[1:-1]]

    # columns: engines, policy, groups, makespan, groups/s, vs 8, vs rl, ...
    assert cells("64", "rl")[5:7] == ["6.00x", "1.00x"]
    assert cells("8", "least_outstanding")[5:7] == ["1.00x", "1.25x"]
    assert cells("64", "least_outstanding")[5:7] == ["4.00x", "0.83x"]


def test_one_policy_has_no_column_against_itself() -> None:
    assert "vs rl" not in rendered([row("rl", 8, 10.0), row("rl", 64, 80.0)])


def test_policy_flags_name_what_is_wrong() -> None:
    assert _policies("rl, least_outstanding") == ("rl", "least_outstanding")
    assert _policies("rl,rl+stream") == ("rl", "rl+stream")
    for bad, message in (
        ("rl,nope", "give scheduler policies"),
        ("nope+stream", "give scheduler policies"),
        ("rl,rl", "twice"),
        (",", "give"),
    ):
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            _policies(bad)


def test_the_publish_column_shows_the_time_beyond_the_load() -> None:
    published = dataclasses.replace(row("rl", 8, 10.0), publish_wall_s=2.5)
    console = Console(width=400, record=True)
    console.print(_table([published], "gpu", load_wall_s=2.0))
    assert "2.50 (+0.50)" in console.export_text()
    assert "publish" not in rendered([dataclasses.replace(published, publish_wall_s=None)])


def test_one_kind_of_publish_a_run() -> None:
    with pytest.raises(ValueError, match="publish_weights and publish_version"):
        run_fleet(FleetConfig(publish_weights=True, publish_version=True))


def test_a_streaming_row_shows_how_long_before_its_group_a_sample_is_there() -> None:
    streaming = dataclasses.replace(row("rl+stream", 8, 10.0), sample_lead_simulated_s=1.42)
    text = rendered([row("rl", 8, 10.0), streaming])
    assert "sample lead" in text and "1.42" in text
    assert "sample lead" not in rendered([row("rl", 8, 10.0)])
