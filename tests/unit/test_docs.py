"""The docs name what the code has: every RPC of the proto in the README's architecture, every
Redis key the services write in docs/stream-format.md (which Redis ACLs are written from:
docs/access.md), every `rollserve` command and benchmark in the README. Nothing is faked:
the names come from the generated descriptors, the key builders and the CLI's own parser."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from rollserve.cli.main import build_parser
from rollserve.client import wire
from rollserve.scheduler.lease import LEASE_KEY
from rollserve.scheduler.store import history_keys
from rollserve.v1 import rollserve_pb2

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
STREAM_FORMAT = (ROOT / "docs" / "stream-format.md").read_text()


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_the_readme_names_every_rpc_of_both_services() -> None:
    (proto_line,) = (p for p in README.split("\n\n") if p.startswith("- `proto/`"))
    for service in ("Scheduler", "Engine"):
        methods = rollserve_pb2.DESCRIPTOR.services_by_name[service].methods
        missing = [m.name for m in methods if not re.search(rf"\b{m.name}\b", proto_line)]
        assert not missing, f"README's proto/ paragraph does not name {service}.{missing}"


def test_the_stream_format_lists_every_redis_key() -> None:
    rows = [line.split("|")[1] for line in STREAM_FORMAT.splitlines() if line.startswith("| `")]
    listed = " ".join(rows)
    run_keys = [
        getattr(wire, name)("R")
        for name in dir(wire)
        if name.endswith("_key") and name not in ("streamed_key",)
    ]
    keys = [
        *run_keys,
        wire.streamed_key("R", "<group_id>"),
        wire.RUNS_KEY,
        wire.WEIGHTS_KEY,
        LEASE_KEY,
    ]
    assert len(run_keys) >= 6  # (the builders are found)
    missing = [k for k in keys if f"`{k}`" not in listed]
    # The predictor's keys share one row: `rollserve:pred:{NS}:keys`, `:used`, ...
    for key in history_keys("NS"):
        suffix = key.rsplit(":", 1)[1]
        if f"`{key}`" not in listed and f"`:{suffix}`" not in listed:
            missing.append(key)
    assert not missing, f"docs/stream-format.md's table lacks {missing}"


def test_the_readme_names_every_command_and_benchmark() -> None:
    commands = subcommands(build_parser())
    missing = [c for c in commands if f"`{c}" not in README]
    missing += [f"bench {b}" for b in subcommands(commands["bench"]) if f"bench {b}" not in README]
    assert not missing, f"README does not name {missing}"
