"""``rollserve status``: what a running scheduler says of itself (its ``Status`` RPC): the
queue, what it delivered, each engine and why one is out of service, the fleet's weights and
how well the length predictor knew the latest samples; as tables, or JSON for scripts."""

from __future__ import annotations

import dataclasses
import json

import grpc
from rich import box
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text
from rollserve.client.credentials import NO_CREDENTIALS, SchedulerCredentials
from rollserve.client.types import EngineStatus, SchedulerStatus
from rollserve.v1 import rollserve_pb2 as pb
from rollserve.v1 import rollserve_pb2_grpc as pb_grpc

UNREACHABLE_EXIT_CODE = 1  # the scheduler did not answer (exit 2 is argparse's)
MAX_ERROR_CHARS = 300  # of an engine's last error shown (--json has it whole)


def fetch(
    address: str, timeout_s: float, credentials: SchedulerCredentials = NO_CREDENTIALS
) -> SchedulerStatus:
    """The scheduler's status; grpc.RpcError when it does not answer within ``timeout_s``
    (or refuses ``credentials``)."""
    with credentials.channel(address) as channel:
        reply = pb_grpc.SchedulerStub(channel).Status(
            pb.StatusRequest(), timeout=timeout_s, metadata=credentials.metadata
        )
    return SchedulerStatus.from_proto(reply)


def run_status(
    address: str,
    timeout_s: float,
    as_json: bool,
    console: Console,
    credentials: SchedulerCredentials = NO_CREDENTIALS,
) -> int:
    try:
        status = fetch(address, timeout_s, credentials)
    except grpc.RpcError as exc:
        code = exc.code().name if isinstance(exc, grpc.Call) else "error"
        details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
        refusals = ("UNAUTHENTICATED", "PERMISSION_DENIED")
        what = "refused the call" if code in refusals else "did not answer"
        console.print(
            f"rollserve status: the scheduler at {address} {what}: {code}: {details}",
            markup=False,
            highlight=False,
        )
        return UNREACHABLE_EXIT_CODE
    if as_json:
        console.print_json(json.dumps(dataclasses.asdict(status)))
    else:
        render(status, console)
    return 0


def render(status: SchedulerStatus, console: Console) -> None:
    summary = Table(show_header=False, box=None, padding=(0, 2))
    summary.add_column(style="bold")
    summary.add_column()
    for name, value in _summary(status):
        summary.add_row(name, Text(value))
    console.print(summary)
    if status.runs:
        runs = Table(title="runs", box=box.SIMPLE_HEAD, padding=(0, 1))
        for column in ("run", "queued", "running"):
            runs.add_column(
                column, justify="left" if column == "run" else "right", no_wrap=column != "run"
            )
        runs.columns[0].overflow = "fold"  # (a run id folds; numbers stay whole)
        for run in status.runs:
            runs.add_row(
                Text(run.run_id),
                f"{run.queued_groups:,}/{run.queued_samples:,}",
                f"{run.running_groups:,}/{run.running_samples:,}",
            )
        runs.caption = "queued, running: groups/samples"
        console.print(runs)
    if not status.engines:
        console.print("no engines: list them with --engine, or start engines that register")
        return
    # Nothing cut short or folded (a number folded onto two lines reads as two): the table
    # where it fits the terminal, else a few lines an engine.
    engines = Table(title="engines", caption=_CAPTION, box=box.SIMPLE_HEAD, padding=(0, 1))
    for column in _COLUMNS:
        engines.add_column(column, justify="right" if column in _NUMERIC else "left", no_wrap=True)
    rows = [_engine_row(engine) for engine in status.engines]
    for row in rows:
        engines.add_row(*row)
    unbounded = console.options.update_width(1 << 16)
    if Measurement.get(console, unbounded, engines).maximum <= console.width:
        console.print(engines)
    else:
        console.print(Text("engines", style="italic"), justify="center")
        for engine_id, *cells in rows:  # a line each, broken between words
            line = engine_id.copy()
            line.stylize("bold")
            for name, cell in zip(_COLUMNS[1:], cells, strict=True):
                line.append(f"  {name} ").append(cell)
            console.print(line)
        console.print(_CAPTION, markup=False, highlight=False)
    # Why each engine is out, a line each (a table cell would break it up).
    for engine in status.engines:
        if not engine.healthy:
            why = engine.last_error or "not probed yet"
            if len(why) > MAX_ERROR_CHARS:
                why = why[:MAX_ERROR_CHARS] + "…"
            console.print(
                f"{engine.engine_id} is out of service: {why}",
                markup=False,
                highlight=False,
                soft_wrap=True,
            )


_COLUMNS = ("engine", "address", "state", "running", "cap.", "dtype", "left", "weights")
_NUMERIC = {"running", "cap.", "left"}
_CAPTION = (
    "running: groups/samples; cap.: most samples run at once; dtype: its model computes in "
    "(blank: not said); left: tokens still to make, predicted/at most; weights: those it serves"
)


def _summary(status: SchedulerStatus) -> list[tuple[str, str]]:
    predictor = f"{status.predictor_keys:,} prompt keys, newest epoch {status.predictor_epoch:,}"
    if status.predictor_scored_samples:
        predictor += f"; over the latest {status.predictor_scored_samples:,} samples"
        if status.predictor_mae_tokens is not None:
            predictor += f" MAE {status.predictor_mae_tokens:,.1f} tokens"
        if status.predictor_tail_auc is not None:
            predictor += f", tail AUC {status.predictor_tail_auc:.3f}"
    return [
        ("queue", f"{status.queue_depth:,} groups waiting for an engine"),
        (
            "in flight",
            f"{status.inflight_groups:,} groups, {status.inflight_samples:,} samples",
        ),
        (
            "delivered",
            f"{status.groups_delivered:,} groups, {status.samples_delivered:,} samples, "
            f"{status.tokens_generated:,} tokens",
        ),
        (
            "not delivered",
            f"{status.groups_failed:,} failed, {status.groups_cancelled:,} cancelled",
        ),
        (
            "engines",
            f"{status.healthy_engines:,} of {len(status.engines):,} in service; "
            f"{status.engine_failures:,} taken out since start",
        ),
        ("preempted", f"{status.samples_preempted:,} times a running sample was stopped"),
        ("fleet weights", _weights(status.fleet_weights_path, status.fleet_weights_version, "")),
        ("length predictor", predictor),
        (
            "earlier outputs",
            f"{status.earlier_outputs_sent:,} carried by calls, "
            f"{status.earlier_outputs_pushed:,} pushed to engines",
        ),
        ("publishes", f"{status.publishes_awaiting_counts:,} awaiting the engines' counts"),
        (
            "streams",
            f"{status.stream_entries_trimmed:,} entries every reader acknowledged, removed",
        ),
    ]


def _engine_row(engine: EngineStatus) -> list[Text]:
    """The engine's cells, in ``_COLUMNS`` order (as written, never as markup)."""
    return [
        Text(engine.engine_id),
        Text(engine.address),
        Text(_state(engine)),
        Text(f"{engine.inflight_groups:,}/{engine.inflight_samples:,}"),
        Text(f"{engine.capacity_samples:,}"),
        Text(engine.dtype),
        Text(f"{engine.predicted_outstanding_tokens:,.0f}/{engine.outstanding_tokens:,}"),
        Text(_weights(engine.weights_path, engine.weights_version, "launch")),
    ]


def _state(engine: EngineStatus) -> str:
    state = "in service" if engine.healthy else "out"
    if engine.loading_weights:
        state += ", loading weights"
    if engine.restarts:
        state += f", restarted {engine.restarts:,}x"
    return state


def _weights(path: str, version: int, unset: str) -> str:
    if not path:
        return unset or "none published: every engine serves its launch weights"
    return f"{path} (version {version:,})"
