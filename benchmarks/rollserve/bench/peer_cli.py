"""The ``rollserve bench peer`` command line (light: the benchmark is imported when it runs)."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path
from typing import Any

from rollserve.cli.argtypes import positive_int
from rollserve.cli.paths import output_dir, output_file


def _split(flag: str, text: str) -> tuple[str, ...]:
    """A flag's value split as a shell would; a ValueError that names the flag if it cannot."""
    try:
        return tuple(shlex.split(text))
    except ValueError as e:
        raise ValueError(f"{flag} ({text!r}) cannot be split into flags: {e}") from None


def add_bench_peer(bench_sub: Any) -> None:
    """Registers ``peer`` under ``rollserve bench``."""
    p: argparse.ArgumentParser = bench_sub.add_parser(
        "peer",
        help="rollserve vs vllm-router in front of vLLM OpenAI servers, same engines and tasks",
    )
    p.add_argument("--model", type=Path, help="default: the shipped trained reasoner")
    p.add_argument("--prompts", type=Path, help="prompt set (default: the shipped one)")
    p.add_argument("--engines", type=positive_int, default=2)
    p.add_argument("--steps", type=positive_int, default=12, help="measured trainer steps (K)")
    p.add_argument("--warmup-steps", type=int, default=1, help="unmeasured steps first")
    p.add_argument("--groups", type=positive_int, default=16, help="groups per step (B)")
    p.add_argument("--n", type=positive_int, default=4, help="samples per group")
    p.add_argument("--max-tokens", type=positive_int, default=1024)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--policy", default="least_outstanding", help="rollserve's scheduler policy")
    p.add_argument(
        "--scheduler-args", default="", help="more scheduler flags for rollserve, one string"
    )
    p.add_argument("--oversample", type=float, default=0.5)
    p.add_argument("--max-staleness", type=int, default=1)
    p.add_argument(
        "--router-policies",
        help="comma-separated vllm-router policies to try on a short run, the best measured "
        "(default: all that need no KV events)",
    )
    p.add_argument("--router-policy", help="measure this vllm-router policy, no trial")
    p.add_argument("--trial-steps", type=positive_int, default=3, help="steps per router policy")
    p.add_argument("--repeats", type=positive_int, default=1, help="rounds, alternating the order")
    p.add_argument(
        "--omp-threads", type=int, default=0, help="per engine, both sides (0: stack default)"
    )
    p.add_argument(
        "--control-plane-nice",
        type=int,
        help="niceness of both sides' control plane (rollserve's engine frontends, scheduler "
        "and Redis; the peer's API servers and router; default: the dev stack's, 10); the "
        "engine cores keep theirs",
    )
    p.add_argument(
        "--interleave",
        action="store_true",
        help="keep both sides up for the whole run and interleave short rounds (each on fresh "
        "prompts, the rows' order rotating), so the machine's drift hits every row alike; "
        "--repeats sets the rounds",
    )
    variant = p.add_argument_group(
        "rollserve B",
        "a second rollserve configuration, measured in the same rounds as the row "
        '"rollserve B" on its own stack (its own engines); any of these adds the row',
    )
    variant.add_argument("--variant-policy", help="its scheduler policy (default: --policy)")
    variant.add_argument(
        "--variant-scheduler-args",
        default="",
        help="more scheduler flags, one string, after --scheduler-args",
    )
    variant.add_argument("--variant-engine-args", default="", help="engine flags, one string")
    p.add_argument(
        "--router-engine-args",
        default="",
        help="speculative decoding on the vllm-router side's servers, as engine flags in one "
        'string (vLLM\'s ngram only), e.g. "--spec-method=ngram --spec-max-batch=8"',
    )
    variant.add_argument(
        "--variant-control-plane-nice",
        type=int,
        help="niceness of its control plane (default: --control-plane-nice)",
    )
    p.add_argument("--run-dir", type=output_dir, help="keep every process's log here")
    p.add_argument("--json", type=output_file)
    p.add_argument(
        "--out-dir",
        type=output_dir,
        default=Path("bench-peer"),
        help="where the PNGs go (rounds, steps, engines, lengths)",
    )
    p.add_argument(
        "--trace",
        type=output_file,
        help="write the measured workload (each group's response lengths) as a trace CSV "
        "that a scenario file replays in the simulator",
    )
    p.set_defaults(func=_cmd_bench_peer)


def _cmd_bench_peer(args: argparse.Namespace) -> int:
    from rollserve.bench.peer import PeerConfig, Variant, run_peer
    from rollserve.bench.peer_router import ROUTER_POLICIES

    policies = tuple(p for p in (args.router_policies or "").split(",") if p)
    nice = (
        {} if args.control_plane_nice is None else {"control_plane_nice": args.control_plane_nice}
    )
    try:
        variant = None
        variant_args = (
            args.variant_policy,
            args.variant_scheduler_args,
            args.variant_engine_args,
            args.variant_control_plane_nice,
        )
        if any(value not in (None, "") for value in variant_args):
            variant = Variant(
                policy=args.variant_policy,
                scheduler_args=_split("--variant-scheduler-args", args.variant_scheduler_args),
                engine_args=_split("--variant-engine-args", args.variant_engine_args),
                control_plane_nice=args.variant_control_plane_nice,
            )
        cfg = PeerConfig(
            model=args.model,
            prompts=args.prompts,
            engines=args.engines,
            steps=args.steps,
            warmup_steps=args.warmup_steps,
            batch=args.groups,
            n=args.n,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            seed=args.seed,
            policy=args.policy,
            scheduler_args=_split("--scheduler-args", args.scheduler_args),
            oversample=args.oversample,
            max_staleness=args.max_staleness,
            router_policies=policies or ROUTER_POLICIES,
            router_policy=args.router_policy,
            trial_steps=args.trial_steps,
            repeats=args.repeats,
            omp_threads=args.omp_threads,
            interleave=args.interleave,
            run_dir=args.run_dir,
            json_path=args.json,
            out_dir=args.out_dir,
            trace_path=args.trace,
            variant=variant,
            router_engine_args=_split("--router-engine-args", args.router_engine_args),
            **nice,
        )
        if cfg.router_engine_args:  # refused here, before anything starts
            from rollserve.assets import reasoner_dir
            from rollserve.bench.peer import router_engine_settings

            router_engine_settings(args.model or reasoner_dir(), cfg.router_engine_args)
    except ValueError as e:
        raise SystemExit(f"rollserve bench peer: {e}") from None
    run_peer(cfg)
    return 0


def add_bench_peer_pool(bench_sub: Any) -> None:
    """Registers ``peer-pool`` under ``rollserve bench``."""
    p: argparse.ArgumentParser = bench_sub.add_parser(
        "peer-pool",
        help="pool the rounds of several `bench peer` runs of one setting (the figure to quote)",
    )
    p.add_argument("files", nargs="+", type=Path, help="`bench peer --json` files")
    p.add_argument("--json", type=output_file, help="write the pooled figures here")
    p.set_defaults(func=_cmd_bench_peer_pool)


def _cmd_bench_peer_pool(args: argparse.Namespace) -> int:
    import json

    from rollserve.bench.peer_pool import load_run, pool_runs, print_pooled, to_json

    try:
        pooled = pool_runs([load_run(path) for path in args.files])
    except ValueError as e:
        raise SystemExit(f"rollserve bench peer-pool: {e}") from None
    print_pooled(pooled)
    if args.json is not None:
        args.json.write_text(json.dumps(to_json(pooled), indent=1))
        print(f"wrote {args.json}")
    return 0
