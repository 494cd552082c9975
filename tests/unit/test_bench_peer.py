"""The pure parts of ``rollserve bench peer``: the peer's command lines and request bodies, the
metrics it reads from vLLM's servers, the figures of its table, and the interleaved rounds'
bookkeeping. No engine, server or router is started."""

from __future__ import annotations

import dataclasses
import io
import itertools
import json
import math
import random
import re
import statistics
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from rollserve.assets import default_prompts, reasoner_dir
from rollserve.bench.peer import (
    PEER,
    ROLLSERVE,
    ROLLSERVE_B,
    ROLLSERVE_SYNC,
    ROWS,
    Environment,
    PeerConfig,
    Variant,
    _drafts,
    _stack_config,
    _variant_report,
    delivered_group,
    engines_on_host,
    offpolicy_over_rounds,
    pooled_interval,
    pooled_ratios,
    print_tables,
    reward_over_rounds,
    round_order,
    round_ratios,
    round_stride,
    to_prompt_group,
    tree_cpu_s,
)
from rollserve.bench.peer_figures import in_flight, write_figures
from rollserve.bench.peer_router import (
    Sampling,
    completion_body,
    counters_delta,
    parse_counters,
    server_argv,
    server_env,
)
from rollserve.bench.peer_stats import (
    DeliveredGroup,
    DeliveredSample,
    PromptStream,
    RowSummary,
    SideRun,
    StepRecord,
    bubble_ratio,
    engine_time_shares,
    same_draws,
    summarize,
)
from rollserve.client import PromptGroup, StepBatcher
from rollserve.client.wire import (
    FinishReason,
    GroupResult,
    GroupStatus,
    Sample,
    VersionSegment,
)
from rollserve.engine.settings import EngineSettings, resolve_dtype
from rollserve.workload import read_prompt_set

from tests.unit.test_batches import FakeRun

METRICS = """\
# HELP vllm:request_success_total Count of successfully processed requests.
vllm:request_success_total{engine="0",finished_reason="stop",model_name="reasoner"} 33.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="reasoner"} 2.0
vllm:prefix_cache_queries_total{engine="0",model_name="reasoner"} 477.0
vllm:prefix_cache_hits_total{engine="0",model_name="reasoner"} 96.0
vllm:num_requests_running{engine="0",model_name="reasoner"} 0.0
"""


def test_the_peer_servers_get_the_engine_services_arguments() -> None:
    settings = EngineSettings(model=reasoner_dir())
    argv = server_argv(settings, 8123)
    flags = dict(itertools.pairwise(argv))
    assert flags["--max-num-seqs"] == str(settings.max_num_seqs)
    assert flags["--block-size"] == str(settings.block_size)
    assert flags["--max-model-len"] == str(settings.max_model_len)
    assert flags["--scheduling-policy"] == settings.scheduling_policy
    assert flags["--logprobs-mode"] == "processed_logprobs"
    assert flags["--dtype"] == resolve_dtype(settings, "cpu")  # float32 where bf16 is emulated
    assert "--enable-prefix-caching" in argv
    assert "--no-enable-chunked-prefill" in argv  # per-request seeds crash it on CPU
    env = server_env(settings, omp_threads=1)
    assert env["VLLM_CPU_KVCACHE_SPACE"] == str(settings.kv_cache_space_gib)
    assert env["OMP_NUM_THREADS"] == "1"
    assert "--speculative-config" not in argv
    assert "NUMBA_NUM_THREADS" not in env


def test_the_peer_servers_speculate_with_vllms_ngram_when_asked() -> None:
    from rollserve.bench.peer import router_engine_settings

    settings = router_engine_settings(
        reasoner_dir(), ["--spec-method=ngram", "--spec-max-batch=8", "--prompt-lookup-max=4"]
    )
    flags = dict(itertools.pairwise(server_argv(settings, 8123)))
    assert json.loads(flags["--speculative-config"]) == {
        "method": "ngram",
        "num_speculative_tokens": 4,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 4,
        "num_speculative_tokens_per_batch_size": [[1, 8, 4], [9, settings.max_num_seqs, 0]],
    }
    assert server_env(settings, omp_threads=1)["NUMBA_NUM_THREADS"] == "1"
    # the servers share the machine's memory as the dev stack's engines do (dtype auto)
    assert settings.engines_per_host == 1
    assert router_engine_settings(reasoner_dir(), [], engines=2).engines_per_host == 2
    for args, message in (
        (["--spec-method=rollout"], "vLLM's own drafters (ngram), not rollout"),
        (
            ["--spec-method=ngram", "--max-num-seqs=32"],
            "speculative decoding only, not max_num_seqs",
        ),
        (["--spec-max-batch=8"], "spec_max_batch set but spec_method is not"),
        (["--no-such-flag"], "are not engine flags"),
    ):
        with pytest.raises(ValueError, match=re.escape(message)):
            router_engine_settings(reasoner_dir(), args)


def test_a_request_is_one_sample_with_its_own_seed_and_logprobs() -> None:
    body = completion_body((0, 5, 6), Sampling(n=4, max_tokens=64, temperature=1.0), seed=1003)
    assert body["prompt"] == [0, 5, 6]
    assert body["seed"] == 1003
    assert body["logprobs"] == 0
    assert body["return_token_ids"] is True
    assert "n" not in body


def test_server_counters_are_read_and_differenced() -> None:
    before = parse_counters(METRICS)
    assert before == {"requests": 35.0, "cache_queries": 477.0, "cache_hits": 96.0}
    after = {"requests": 45.0, "cache_queries": 577.0, "cache_hits": 146.0}
    delta = counters_delta([before, before], [after, before])
    assert delta == {
        "cache_queries": 100.0,
        "cache_hits": 50.0,
        "requests:0": 10.0,
        "requests:1": 0,
    }


def test_both_sides_get_the_same_prompts_and_seeds() -> None:
    a = PromptStream(reasoner_dir(), None, seed=3)
    b = PromptStream(reasoner_dir(), None, seed=3)
    assert [a.group(i) for i in range(5)] == [b.group(i) for i in range(5)]
    assert a.group(2).seed == 3 + 2000
    assert a.group(len(a.rows)).prompt_key == a.group(0).prompt_key  # the stream repeats
    group = to_prompt_group(a.group(7), Sampling(n=4, max_tokens=128, temperature=1.0))
    assert group.group_id == "g7"
    assert group.sampling.seed == a.group(7).seed
    assert group.n == 4


def run_of(name: str, stream: PromptStream, answers: dict[int, str]) -> SideRun:
    """Two steps of two groups; group i's two samples answer ``answers[i]``."""
    tokenizer_encode = stream._tokenizer.encode  # the model's tokenizer
    groups = []
    for index, text in answers.items():
        ids = tuple(tokenizer_encode(text).ids)
        samples = (
            DeliveredSample(ids, "stop", "engine-0", 10, 0, spec_proposed_tokens=8, spec_drafts=2),
            DeliveredSample(
                ids[:1],
                "length",
                "engine-1",
                10,
                5,
                spec_proposed_tokens=4,
                spec_accepted_tokens=3,
                spec_drafts=1,
            ),
        )
        step = index // 2
        groups.append(DeliveredGroup(index, stream.group(index).prompt_key, step, step, samples))
    return SideRun(
        name=name,
        steps=[StepRecord(0, 2.0, 2, 10), StepRecord(1, 6.0, 2, 10)],
        groups=groups,
        wall_s=8.0,
        cache_queries=40,
        cache_hits=10,
        samples_per_engine={"engine-0": 4, "engine-1": 4},
        engines=2,
        engine_core_cpu_s=10.0,
        engine_core_wait_s=2.0,
    )


def test_summaries_score_the_delivered_samples() -> None:
    stream = PromptStream(reasoner_dir(), None, seed=0)
    rows = {r.prompt_key: r for r in read_prompt_set(default_prompts())}
    answers = {i: "answer " + rows[stream.group(i).prompt_key].answer for i in range(4)}
    run = run_of(ROLLSERVE, stream, answers)
    summary = summarize(run, stream)
    assert summary.groups == 4
    assert summary.groups_per_s == 0.5
    assert summary.makespan_s == 4.0
    assert summary.max_step_s == 6.0
    assert summary.mean_reward == 0.5  # the full answers score 1, the cut-off ones 0
    assert summary.mixed_group_share == 1.0
    assert summary.length_cut_share == 0.5
    assert summary.staleness == {0: 4}
    assert summary.prefix_hit_rate == 0.25
    assert summary.bubble_ratio == 0.25  # 10 CPU-s + 2 s of waits of 2 engines x 8 s
    assert summary.cpu_wait_share == 0.125
    assert summary.offpolicy_token_fraction == 0.0  # no token of an older version
    assert summary.engine_share == {"engine-0": 0.5, "engine-1": 0.5}
    assert (summary.draft_tokens, summary.accepted_draft_tokens) == (48, 12)  # 4 groups
    assert summary.drafted_passes == 12
    made = 12 / summary.output_tokens
    assert _drafts(summary) == f"25% ({made:.0%} of tokens, 2.00 a drafted pass)"
    assert _drafts(dataclasses.replace(summary, draft_tokens=0, accepted_draft_tokens=0)) == "-"
    both, same = same_draws(run, run_of(PEER, stream, {**answers, 3: "pass 1"}))
    assert (both, same) == (8, 7)  # group 3 differs in its full sample only


def test_the_tables_print(tmp_path: Path) -> None:
    stream = PromptStream(reasoner_dir(), None, seed=0)
    answers = {i: "answer 1" for i in range(4)}
    rows = {
        name: summarize(run_of(name, stream, answers), stream)
        for name in (PEER, ROLLSERVE, ROLLSERVE_SYNC)
    }
    out = io.StringIO()
    console = Console(file=out, width=80)
    env = Environment(
        cfg=PeerConfig(),
        model=reasoner_dir(),
        stream=stream,
        sampling=Sampling(4, 1024, 1.0),
        omp_threads=1,
        log_dir=tmp_path,
        console=console,
        trial=[
            {"policy": "cache_aware", "groups_per_s": 1.0, "mean_step_s": 2.0, "output_tokens": 5}
        ],
        router_policy="cache_aware",
    )
    print_tables(rows, env, {name: [0.5] for name in rows})
    text = out.getvalue()
    assert "cache_aware (used)" in text
    assert "1.00x" in text
    assert "least_outstanding (over 0.5, stale <= 1)" in text


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"steps": 0}, r"steps \(0\) must be >= 1"),
        ({"warmup_steps": -1}, r"warmup_steps \(-1\) must be >= 0"),
        ({"control_plane_nice": 20}, r"control_plane_nice \(20\) must be in 0\.\.19"),
        ({"control_plane_nice": -1}, r"control_plane_nice \(-1\) must be in 0\.\.19"),
        ({"router_policy": "fastest"}, r"router policies \['fastest'\] unknown"),
        # A trainer at staleness 1 cannot deliver more carried groups than one batch holds.
        ({"oversample": 2.0}, r"oversample \(2\.0\) must be in \[0, 1\]"),
        ({"oversample": -0.5}, r"oversample \(-0\.5\) must be in \[0, 1\]"),
        ({"max_staleness": -1}, r"max_staleness \(-1\) must be >= 0"),
        ({"omp_threads": -2}, r"omp_threads \(-2\) must be >= 0"),
        ({"temperature": float("nan")}, r"temperature \(nan\) must be a number >= 0"),
        ({"step_timeout_s": 0.0}, r"step_timeout_s \(0\.0\) must be > 0"),
        ({"policy": "fastest"}, r"policy \('fastest'\) unknown; rollserve's policies: "),
    ],
)
def test_bad_settings_are_refused_with_the_field(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PeerConfig(**kwargs)


def rounds(name: str, *walls: float) -> list[RowSummary]:
    """A row's summaries, one a round: 4 groups in each, delivered in ``walls`` seconds."""
    stream = PromptStream(reasoner_dir(), None, seed=0)
    answers = {i: "answer 1" for i in range(4)}
    out = []
    for wall in walls:
        run = run_of(name, stream, answers)
        run.wall_s = wall
        out.append(summarize(run, stream))
    return out


def test_pooled_ratios_weigh_rounds_by_their_time() -> None:
    summaries = {
        PEER: rounds(PEER, 4.0, 4.0),  # 1 group/s a round
        ROLLSERVE: rounds(ROLLSERVE, 1.0, 4.0),  # 4 and 1 group/s
        ROLLSERVE_SYNC: rounds(ROLLSERVE_SYNC, 2.0, 2.0),
    }
    per_round = round_ratios({n: [r.groups_per_s for r in rs] for n, rs in summaries.items()})
    assert per_round[ROLLSERVE] == [4.0, 1.0]
    pooled = pooled_ratios(summaries)
    assert pooled[ROLLSERVE] == 8 / 5  # 8 groups in 5 s against 8 in 8 s
    assert pooled[ROLLSERVE_SYNC] == 2.0
    assert pooled_interval(summaries) == {}  # too few rounds to resample


def test_the_pooled_ratios_interval_holds_the_rounds_spread() -> None:
    summaries = {
        PEER: rounds(PEER, 4.0, 4.0, 4.0, 4.0, 4.0),
        ROLLSERVE: rounds(ROLLSERVE, 1.0, 2.0, 2.0, 2.0, 4.0),  # pooled: 20 in 11 s vs 20 in 20
        ROLLSERVE_SYNC: rounds(ROLLSERVE_SYNC, 4.0, 4.0, 4.0, 4.0, 4.0),
    }
    interval = pooled_interval(summaries)
    low, high = interval[ROLLSERVE]
    assert 1.0 < low < pooled_ratios(summaries)[ROLLSERVE] < high < 4.0
    assert interval[ROLLSERVE_SYNC] == (1.0, 1.0)  # every round alike: no spread
    assert pooled_interval(summaries) == interval  # seeded: the same every run
    assert reward_over_rounds(summaries[PEER]) == summaries[PEER][0].mean_reward
    first, second = summaries[ROLLSERVE][:2]
    weighed = [  # 10% of 100 tokens and 40% of 300: 130 of 400 tokens, not the 25% mean
        dataclasses.replace(first, output_tokens=100, offpolicy_token_fraction=0.1),
        dataclasses.replace(second, output_tokens=300, offpolicy_token_fraction=0.4),
    ]
    assert offpolicy_over_rounds(weighed) == pytest.approx(130 / 400)
    assert offpolicy_over_rounds([]) == 0.0


def test_interleaved_rounds_rotate_the_rows_evenly() -> None:
    orders = [round_order(rep) for rep in range(6)]
    assert all(sorted(order) == sorted(ROWS) for order in orders)
    for name in ROWS:  # over six rounds every row runs in every position twice
        positions = sorted(order.index(name) for order in orders)
        assert positions == [0, 0, 1, 1, 2, 2]
    assert orders[1] == tuple(reversed(orders[0]))
    assert round_order(6) == orders[0]


def test_a_variant_adds_a_fourth_row_that_rotates_with_the_others() -> None:
    cfg = PeerConfig(variant=Variant(policy="rl"))
    assert cfg.rows == (*ROWS, ROLLSERVE_B)
    assert PeerConfig().rows == ROWS
    assert cfg.oversample_of(ROLLSERVE_B) == cfg.oversample_of(ROLLSERVE) == cfg.oversample
    assert cfg.oversample_of(ROLLSERVE_SYNC) == 0.0
    orders = [round_order(rep, cfg.rows) for rep in range(8)]
    for name in cfg.rows:  # over eight rounds every row runs in every position twice
        assert sorted(order.index(name) for order in orders) == [0, 0, 1, 1, 2, 2, 3, 3]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, r"variant sets nothing"),
        ({"policy": "fastest"}, r"variant policy \('fastest'\) unknown; rollserve's policies: "),
        ({"control_plane_nice": 20}, r"variant control_plane_nice \(20\) must be in 0\.\.19"),
    ],
)
def test_a_bad_variant_is_refused_with_the_field(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Variant(**kwargs)


def test_the_variant_row_gets_its_own_stack_settings(tmp_path: Path) -> None:
    variant = Variant(
        policy="rl",
        scheduler_args=("--capacity-factor", "2"),
        engine_args=("--flush-interval-ms", "100"),
        control_plane_nice=5,
    )
    cfg = PeerConfig(scheduler_args=("--max-attempts", "4"), variant=variant)
    env = Environment(
        cfg=cfg,
        model=reasoner_dir(),
        stream=PromptStream(reasoner_dir(), None, seed=0),
        sampling=Sampling(4, 1024, 1.0),
        omp_threads=1,
        log_dir=tmp_path,
        console=Console(file=io.StringIO()),
    )
    main = _stack_config(env, ROLLSERVE, ROLLSERVE)
    b = _stack_config(env, ROLLSERVE_B, ROLLSERVE_B)
    assert main.scheduler_args == ("--policy", "least_outstanding", "--max-attempts", "4")
    assert (main.engine_args, main.control_plane_nice) == ((), cfg.control_plane_nice)
    # not interleaved: one side's engines up at a time
    assert main.engines_per_host == b.engines_per_host == 2
    # The variant's flags come after the main row's, so that they win where both set one.
    assert b.scheduler_args == (
        "--policy",
        "rl",
        "--max-attempts",
        "4",
        "--capacity-factor",
        "2",
    )
    assert (b.engine_args, b.control_plane_nice) == (("--flush-interval-ms", "100"), 5)
    assert b.run_dir != main.run_dir
    assert variant.describe() == (
        "rl, scheduler --capacity-factor 2, engines --flush-interval-ms 100, nice 5"
    )


def test_engines_count_every_side_up_at_once_on_the_machine() -> None:
    """Interleaved, the router's servers and each rollserve stack stay up together: each
    engine resolves dtype auto counting all of them, and both sides resolve alike."""
    assert engines_on_host(PeerConfig(engines=2)) == 2
    assert engines_on_host(PeerConfig(engines=2, interleave=True)) == 4
    assert engines_on_host(PeerConfig(engines=2, interleave=True, variant=Variant("rl"))) == 6
    assert engines_on_host(PeerConfig(engines=3, variant=Variant("rl"))) == 3


def test_the_variant_is_compared_with_rollserve_round_by_round_and_pooled() -> None:
    walls = (4.0, 4.0, 4.0, 4.0)
    summaries = {
        PEER: rounds(PEER, *walls),
        ROLLSERVE: rounds(ROLLSERVE, 2.0, 2.0, 2.0, 2.0),
        ROLLSERVE_SYNC: rounds(ROLLSERVE_SYNC, *walls),
        ROLLSERVE_B: rounds(ROLLSERVE_B, 1.0, 2.0, 1.0, 4.0),  # pooled: 16 in 8 s vs 16 in 8
    }
    gps = {name: [r.groups_per_s for r in rows] for name, rows in summaries.items()}
    cfg = PeerConfig(variant=Variant(policy="rl"))
    pooled, interval = pooled_ratios(summaries), pooled_interval(summaries)
    report = _variant_report(cfg, summaries, round_ratios(gps), pooled, interval)
    assert report["vs_rollserve_per_round"] == [2.0, 1.0, 2.0, 0.5]
    assert report["vs_rollserve_pooled"] == 1.0
    low, high = report["vs_rollserve_pooled_interval_90"]
    assert low < 1.0 < high
    assert report["ratio_pooled"] == 2.0  # 16 groups in 8 s against 16 in 16
    assert report["ratio"] == statistics.median([4.0, 2.0, 4.0, 1.0])
    assert report["settings"]["policy"] == "rl"
    assert report["ratio_pooled_interval_90"] == interval[ROLLSERVE_B]
    assert _variant_report(PeerConfig(), summaries, round_ratios(gps), pooled, interval) == {}


def test_a_bad_flag_string_is_refused_naming_the_flag() -> None:
    from rollserve.cli.main import main

    argv = ["bench", "peer", "--variant-engine-args", "--flush-interval-ms '100"]
    with pytest.raises(SystemExit) as refused:
        main(argv)
    assert "--variant-engine-args" in str(refused.value)
    assert "cannot be split into flags" in str(refused.value)


@pytest.mark.parametrize(("oversample", "max_staleness"), [(0.0, 1), (0.5, 1), (1.0, 2)])
def test_an_interleaved_round_stays_inside_its_slice_of_the_stream(
    oversample: float, max_staleness: int
) -> None:
    """The step batcher, driven as a round drives it (warm-up, measured steps, then the tail
    cancelled) over a long-tailed fake run, never takes a group beyond the round's stride:
    the next round starts on prompts no side has seen. Faked: the client's edges
    (``FakeRun``, a virtual clock); real: the batcher."""
    cfg = PeerConfig(steps=5, warmup_steps=2, batch=16, oversample=oversample)
    rng = random.Random(7)
    durations: dict[str, float | None] = {
        f"g{i}": rng.lognormvariate(0.0, 1.2) for i in range(10_000)
    }
    fake = FakeRun(durations)
    taken: list[int] = []

    def groups() -> Iterator[PromptGroup]:
        for index in itertools.count():
            taken.append(index)
            yield PromptGroup(group_id=f"g{index}", prompt_token_ids=(1, 2), n=4)

    batcher = StepBatcher(
        fake,
        groups(),
        batch_size=cfg.batch,
        oversample=oversample,
        max_staleness=max_staleness,
        batch_timeout_s=1e6,
    )
    for _ in range(cfg.warmup_steps + cfg.steps):
        batcher.ack(next(batcher))
    batcher.cancel_outstanding(drain_timeout_s=0)
    assert len(fake.submitted) == len(taken)
    assert max(taken) < round_stride(cfg)


def test_process_tree_cpu_counts_the_descendants() -> None:
    """A shell whose grandchild burns 0.3 s of its own CPU time: the shell's tree counts it."""
    burn = (
        "import time\nwhile time.process_time() < 0.3: pass\n"
        "print('done', flush=True)\ntime.sleep(30)\n"
    )
    shell = subprocess.Popen(
        ["sh", "-c", f'{sys.executable} -c "$0"', burn],
        stdout=subprocess.PIPE,
    )
    try:
        assert shell.stdout is not None
        assert shell.stdout.readline().strip() == b"done"
        assert tree_cpu_s([shell.pid]) >= 0.28
        assert tree_cpu_s([2**22 + 12345]) == 0.0  # no such process
    finally:
        shell.kill()
        shell.wait()


def test_tokens_of_an_older_version_than_the_trainer_s_count_as_off_policy() -> None:
    sample = Sample(
        sample_id="g3/0",
        index=0,
        token_ids=[5] * 10,
        logprobs=[-0.5] * 10,
        finish_reason=FinishReason.STOP,
        engine_id="e0",
        versions=[VersionSegment(3, 4), VersionSegment(4, 6)],
        spec_proposed_tokens=6,
        spec_accepted_tokens=2,
        spec_drafts=2,
    )
    result = GroupResult(run_id="r", group_id="g3", status=GroupStatus.DELIVERED, samples=[sample])
    # Launched in step 0 (version 3), taken in step 1 (version 4): the first 4 tokens are
    # the version before.
    group = delivered_group(result, launch_step=0, delivery_step=1, version=4)
    assert (group.index, group.staleness) == (3, 1)
    assert group.samples[0].offpolicy_tokens == 4
    first = group.samples[0]
    assert (first.spec_proposed_tokens, first.spec_accepted_tokens, first.spec_drafts) == (6, 2, 2)
    assert delivered_group(result, 0, 0, version=3).samples[0].offpolicy_tokens == 0

    stream = PromptStream(reasoner_dir(), None, seed=0)
    run = run_of(ROLLSERVE, stream, {i: "answer 1" for i in range(4)})
    late = run.groups[3]
    samples = tuple(dataclasses.replace(s, offpolicy_tokens=1) for s in late.samples)
    run.groups[3] = dataclasses.replace(late, launch_step=late.launch_step - 1, samples=samples)
    summary = summarize(run, stream)
    assert summary.staleness == {0: 3, 1: 1}
    assert summary.offpolicy_token_fraction == pytest.approx(2 / summary.output_tokens)


def test_the_bubble_is_unknown_unless_measured_and_stays_in_0_1() -> None:
    assert math.isnan(bubble_ratio(0.0, 2, 8.0))  # not measured
    assert math.isnan(bubble_ratio(4.0, 0, 8.0))
    assert bubble_ratio(4.0, 2, 8.0) == 0.75
    assert bubble_ratio(20.0, 2, 8.0) == 0.0  # more CPU than wall: a core's other threads


def test_the_figures_are_drawn_from_the_runs(tmp_path: Path) -> None:
    stream = PromptStream(reasoner_dir(), None, seed=0)
    answers = {i: "answer 1" for i in range(4)}
    runs = {name: [run_of(name, stream, answers)] * 2 for name in (PEER, ROLLSERVE)}
    runs[ROLLSERVE_SYNC] = [dataclasses.replace(runs[PEER][0], engines=0)] * 2  # unmeasured
    paths = write_figures(
        runs,
        {PEER: [1.0, 1.0], ROLLSERVE: [1.4, 1.6], ROLLSERVE_SYNC: [1.0, 0.9]},
        {ROLLSERVE: 1.5, ROLLSERVE_SYNC: 0.95},
        goal=1.5,
        out_dir=tmp_path / "figs",
        base=PEER,
    )
    assert [p.name for p in paths] == [
        "rounds.png",
        "steps.png",
        "engines.png",
        "lengths.png",
        "inflight.png",
    ]
    for path in paths:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    computing, waiting = engine_time_shares(runs[ROLLSERVE])
    assert (computing, waiting) == (10.0 / 16, 2.0 / 16)  # 2 engines x 8 s a round
    assert all(math.isnan(x) for x in engine_time_shares(runs[ROLLSERVE_SYNC]))


def test_samples_in_flight_count_from_each_start_to_each_end_inside_the_window() -> None:
    def sample(start: float, end: float) -> DeliveredSample:
        return DeliveredSample((1, 2), "stop", "e0", started_at=start, finished_at=end)

    group = DeliveredGroup(
        0,
        "k",
        0,
        0,
        # Carried over from before the window, two that overlap, one that ends after it, and
        # one with no times (not drawn).
        (sample(95.0, 101.0), sample(100.5, 102.0), sample(101.0, 103.0), sample(102.5, 120.0)),
    )
    unknown = DeliveredGroup(1, "k", 0, 0, (DeliveredSample((1,), "stop", "e0"),))
    run = SideRun(name="x", groups=[group, unknown], wall_s=4.0, start_at=100.0)
    times, counts = in_flight(run)
    assert list(zip(times, counts, strict=True)) == [
        (0.0, 1),
        (0.5, 2),
        (1.0, 2),  # one ends as another starts
        (2.0, 1),
        (2.5, 2),
        (3.0, 1),
        (4.0, 0),  # the window's end
    ]
