"""``rollserve sim engine|fleet`` and ``rollserve bench fleet``: simulated engines.

``rollserve sim`` hands its arguments to the sim service (``rollserve.sim.server``), whose flags
are its settings; ``rollserve bench fleet`` runs the real scheduler against sim fleets of
several sizes (``rollserve.bench.fleet``). Both import their modules only when run.
"""

from __future__ import annotations

import argparse
from typing import Any

from rollserve.cli.argtypes import positive_float, positive_int
from rollserve.cli.paths import output_dir, output_file


def main(argv: list[str]) -> int:
    """``rollserve sim ...``: serve one sim engine or a fleet."""
    from rollserve.sim.server import main as sim_main

    return sim_main(argv)


def _engine_counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of counts"
        ) from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give engine counts of at least 1, e.g. 8,64")
    return counts


def _tenant_modes(text: str) -> tuple[str, ...]:
    from rollserve.bench.tenants import MODE_NAMES

    names = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = [name for name in names if name not in MODE_NAMES]
    if not names or unknown:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give modes from {', '.join(MODE_NAMES)}, comma-separated"
        )
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"{text!r} names a mode twice")
    return tuple(MODE_NAMES[name] for name in names)


def _policies(text: str) -> tuple[str, ...]:
    from rollserve.bench.fleet import STREAM
    from rollserve.scheduler.core.policy import policy_names

    names = tuple(part.strip() for part in text.split(",") if part.strip())
    known = policy_names()
    unknown = [name for name in names if name.removesuffix(STREAM) not in known]
    if not names or unknown:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give scheduler policies from {', '.join(known)} (each also as "
            f"NAME{STREAM}: its groups streaming their samples), comma-separated"
        )
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"{text!r} names a policy twice")
    return names


def add_bench_fleet(bench_sub: Any) -> None:
    """Adds ``fleet`` to the ``rollserve bench`` subcommands."""
    from rollserve.bench.fleet import FleetConfig

    defaults = FleetConfig()
    fleet = bench_sub.add_parser(
        "fleet",
        help="the real scheduler against sim fleets of several sizes (simulated engines)",
        description=(
            "Starts Redis, the real scheduler and a sim fleet per engine count; submits groups "
            "with the client SDK and reads them from the stream. Engine time is simulated."
        ),
    )
    fleet.add_argument(
        "--engines",
        type=_engine_counts,
        default=defaults.engines,
        help="comma-separated engine counts, one row each (default: 8,64,512)",
    )
    fleet.add_argument(
        "--groups",
        type=positive_int,
        default=defaults.groups_per_engine,
        help=f"groups per engine: the load grows with the fleet "
        f"(default: {defaults.groups_per_engine})",
    )
    fleet.add_argument(
        "--n", type=positive_int, default=defaults.n, help=f"samples per group ({defaults.n})"
    )
    fleet.add_argument(
        "--time-scale",
        type=positive_float,
        default=defaults.time_scale,
        help=f"real seconds per simulated second ({defaults.time_scale})",
    )
    fleet.add_argument(
        "--policy",
        type=_policies,
        default=defaults.policies,
        help="scheduler placement policies, comma-separated: a row each per engine count, "
        "side by side; NAME+stream: its groups submitted with stream_samples "
        f"(default: {','.join(defaults.policies)})",
    )
    fleet.add_argument("--profile", default=defaults.profile, help="sim cost profile")
    fleet.add_argument(
        "--median",
        type=positive_float,
        default=defaults.response_median,
        help=f"median response length, tokens ({defaults.response_median:g})",
    )
    fleet.add_argument(
        "--max-tokens",
        type=positive_int,
        default=defaults.max_tokens,
        help=f"max_tokens of every group ({defaults.max_tokens})",
    )
    fleet.add_argument("--seed", type=int, default=defaults.seed)
    publishing = fleet.add_mutually_exclusive_group()
    publishing.add_argument(
        "--publish-weights",
        action="store_true",
        help="half way, publish a new policy version with weights: every engine pauses for "
        "its profile's weights_load_s and recomputes its running samples",
    )
    publishing.add_argument(
        "--publish-version",
        action="store_true",
        help="half way, publish a new policy version without weights: the scheduler asks "
        "every engine what its samples have made, to label the tokens made before it",
    )
    fleet.add_argument("--json", type=output_file, help="also write the results here")
    fleet.add_argument(
        "--run-dir", type=output_dir, help="keep the logs here (default: a temp dir)"
    )
    fleet.set_defaults(func=_cmd_bench_fleet)


def _cmd_bench_fleet(args: argparse.Namespace) -> int:
    from rollserve.bench.fleet import FleetConfig, run_fleet

    run_fleet(
        FleetConfig(
            engines=args.engines,
            groups_per_engine=args.groups,
            n=args.n,
            time_scale=args.time_scale,
            policies=args.policy,
            profile=args.profile,
            response_median=args.median,
            max_tokens=args.max_tokens,
            seed=args.seed,
            publish_weights=args.publish_weights,
            publish_version=args.publish_version,
            json_path=args.json,
            run_dir=args.run_dir,
        )
    )
    return 0


def add_bench_tenants(bench_sub: Any) -> None:
    """Adds ``tenants`` to the ``rollserve bench`` subcommands."""
    from rollserve.bench.tenants import TenantsConfig

    defaults = TenantsConfig()
    tenants = bench_sub.add_parser(
        "tenants",
        help="two runs on one sim fleet: a backlog and a synchronous trainer, with and "
        "without fair share (simulated engines)",
        description=(
            "Per policy: trainer B's synchronous steps alone, then beside run A's backlog with "
            "the scheduler's --no-fair-share, then with fair share. Engine time is simulated."
        ),
    )
    tenants.add_argument(
        "--engines", type=positive_int, default=defaults.engines, help="sim engines"
    )
    tenants.add_argument(
        "--backlog",
        type=positive_int,
        default=defaults.backlog_groups,
        help=f"groups run A queues at once ({defaults.backlog_groups})",
    )
    tenants.add_argument(
        "--step-groups",
        type=positive_int,
        default=defaults.step_groups,
        help=f"groups of each of B's steps ({defaults.step_groups})",
    )
    tenants.add_argument(
        "--steps", type=positive_int, default=defaults.steps, help=f"B's steps ({defaults.steps})"
    )
    tenants.add_argument(
        "--n", type=positive_int, default=defaults.n, help=f"samples per group ({defaults.n})"
    )
    tenants.add_argument(
        "--time-scale",
        type=positive_float,
        default=defaults.time_scale,
        help=f"real seconds per simulated second ({defaults.time_scale})",
    )
    tenants.add_argument(
        "--policy",
        type=_policies,
        default=defaults.policies,
        help=f"scheduler policies, comma-separated ({','.join(defaults.policies)})",
    )
    tenants.add_argument(
        "--modes",
        type=_tenant_modes,
        default=defaults.modes,
        help="rows to run per policy, comma-separated: alone (B alone), arrival (A's backlog "
        "with --no-fair-share), fair (with fair share) (all three)",
    )
    tenants.add_argument("--profile", default=defaults.profile, help="sim cost profile")
    tenants.add_argument(
        "--median",
        type=positive_float,
        default=defaults.response_median,
        help=f"median response length, tokens ({defaults.response_median:g})",
    )
    tenants.add_argument("--seed", type=int, default=defaults.seed)
    tenants.add_argument("--json", type=output_file, help="also write the results here")
    tenants.set_defaults(func=_cmd_bench_tenants)


def _cmd_bench_tenants(args: argparse.Namespace) -> int:
    from rollserve.bench.tenants import TenantsConfig, run_tenants

    run_tenants(
        TenantsConfig(
            engines=args.engines,
            backlog_groups=args.backlog,
            step_groups=args.step_groups,
            steps=args.steps,
            n=args.n,
            time_scale=args.time_scale,
            policies=args.policy,
            modes=args.modes,
            profile=args.profile,
            response_median=args.median,
            seed=args.seed,
            json_path=args.json,
        )
    )
    return 0
