"""``rollserve bench tenants``'s flags and table (the rows themselves need processes: run the
command; nothing here starts one)."""

from __future__ import annotations

from rich.console import Console
from rollserve.bench.tenants import MODES, TenantsConfig, TenantsRow, _table
from rollserve.cli.main import build_parser


def row(policy: str, mode: str, steps: tuple[float, ...], a_delivered: int) -> TenantsRow:
    return TenantsRow(
        policy=policy,
        mode=mode,
        b_step_simulated_s=steps,
        b_mean_step_simulated_s=sum(steps) / len(steps),
        a_groups_delivered=a_delivered,
        a_groups_per_simulated_s=a_delivered / sum(steps),
        fleet_behind_s=0.0,
        a_drained=a_delivered == 100,
        engine_batch=123.4,
        engine_preemptions=7,
    )


def test_each_mode_is_compared_with_b_alone_under_its_own_policy() -> None:
    rows = [
        row("rl", MODES[0], (2.0, 2.0), 0),
        row("rl", MODES[1], (40.0, 2.0), 100),
        row("rl", MODES[2], (5.0, 5.0), 80),
        row("least_outstanding", MODES[0], (4.0, 4.0), 0),
        row("least_outstanding", MODES[2], (6.0, 6.0), 70),
    ]
    console = Console(width=300, record=True)
    console.print(_table(rows, "gpu"))
    lines = [
        [cell.strip() for cell in line.split("│")[1:-1]]
        for line in console.export_text().splitlines()
        if "│" in line
    ]
    by = {(cells[0], cells[1]): cells for cells in lines}
    # columns: policy, mode, mean, max, vs alone, A delivered, A groups/s, batch, preemptions
    assert by[("rl", "arrival order")][2:5] == ["21.00", "40.00", "10.50x"]
    assert by[("rl", "fair share")][4:6] == ["2.50x", "80"]
    assert by[("least_outstanding", "fair share")][4] == "1.50x"
    assert by[("rl", "B alone")][5:7] == ["-", "-"]
    assert by[("rl", "arrival order")][6].endswith("(drained)")
    assert not by[("rl", "fair share")][6].endswith("(drained)")
    assert by[("rl", "fair share")][7:] == ["123", "7"]  # the engines' batch, preemptions


def test_its_flags_make_its_config() -> None:
    args = build_parser().parse_args(
        ["bench", "tenants", "--engines", "4", "--backlog", "512", "--policy", "rl"]
    )
    assert (args.engines, args.backlog, args.policy) == (4, 512, ("rl",))
    assert args.steps == TenantsConfig().steps
