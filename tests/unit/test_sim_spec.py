"""Speculative decoding in the simulator: its cost model, the profile's [spec] table, the
simulated engine and the bench's "+spec" rows (no files but tmp ones, no time)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from rich.console import Console
from rollserve.bench.policies import PoliciesConfig, run_policies
from rollserve.sim.engine_model import Finished, SimEngine, SimRequest
from rollserve.sim.profile import CostProfile, SpecDecoding, load_profile
from rollserve.v1 import rollserve_pb2 as pb

from tests.unit.test_sim_engine import BASE, PER_KV, PER_PREFILL, PER_SEQ
from tests.unit.test_sim_engine import make_profile as make_engine_profile
from tests.unit.test_sim_server import collect, generate_request, sim_engine


def make_profile(spec: SpecDecoding | None = None) -> CostProfile:
    """test_sim_engine's hand-made profile, with room for the tests' contexts."""
    return make_engine_profile(kv_capacity_tokens=4096, spec=spec)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"draft_tokens": 0, "accept_len": 1.0}, r"draft_tokens \(0\) must be at least 1"),
        ({"draft_tokens": 3, "accept_len": 4.5}, r"accept_len \(4.5\) must be between 1 and"),
        ({"draft_tokens": 3, "accept_len": 0.9}, r"accept_len \(0.9\) must be between 1 and"),
        ({"draft_tokens": 3, "accept_len": 2.0, "max_batch": -1}, r"max_batch \(-1\)"),
        ({"draft_tokens": 3, "accept_len": 2.0, "draft_s": -1e-6}, r"draft_s \(-1e-06\)"),
        ({"draft_tokens": 3, "accept_len": 2.0, "pass_s": -1e-3}, r"pass_s \(-0.001\)"),
        ({"draft_tokens": 3, "accept_len": 2.0, "token_s": -1e-6}, r"token_s \(-1e-06\)"),
        ({"draft_tokens": 3, "accept_len": 2.0, "drafted": 3.5}, r"drafted \(3.5\) must be"),
        (
            {"draft_tokens": 3, "accept_len": 2.5, "drafted": 1.2},
            r"accept_len \(2.5\) must be between 1 and drafted \+ 1 \(2.2\)",
        ),
        (
            {"draft_tokens": 3, "accept_len": 2.0, "accept_by_history": (1.5, 4.5)},
            r"accept_by_history\[1\] \(4.5\) must be between 1 and 4",
        ),
        (
            {"draft_tokens": 3, "accept_len": 2.0, "history_outputs": -1},
            r"history_outputs \(-1\) must be >= 0",
        ),
    ],
)
def test_spec_validation_names_the_field(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SpecDecoding(**kwargs)  # type: ignore[arg-type]


def test_a_speculating_step_is_a_share_of_a_verification_pass() -> None:
    spec = SpecDecoding(draft_tokens=3, accept_len=2.5, max_batch=4, draft_s=0.02)
    profile = make_profile(spec)
    plain = make_profile()
    # 4 sequences (within max_batch): the pass verifies 3 drafts + 1 per sequence and reads
    # the weights and each context once; it advances each sequence 2.5 tokens on average.
    verify = BASE + (PER_SEQ * 4 + 0.02) * 4 + PER_KV * 100
    assert profile.step_time(4, 20, 100) == pytest.approx(verify / 2.5 + PER_PREFILL * 20)
    # Above max_batch, and with nothing decoding, no speculation: the plain model.
    assert profile.step_time(5, 20, 100) == pytest.approx(plain.step_time(5, 20, 100))
    assert profile.step_time(0, 20, 0) == pytest.approx(plain.step_time(0, 20, 0))
    # The speculative path's own cost: once a pass, whatever the batch or the drafts.
    fixed = make_profile(replace(spec, pass_s=0.5))
    assert fixed.step_time(4, 20, 100) == pytest.approx((verify + 0.5) / 2.5 + PER_PREFILL * 20)
    assert fixed.step_time(5, 20, 100) == pytest.approx(plain.step_time(5, 20, 100))
    # max_batch 0: every step speculates.
    always = make_profile(replace(spec, max_batch=0))
    assert always.step_time(8, 0, 0) < plain.step_time(8, 0, 0) * 2
    assert always.step_time(8, 0, 0) != plain.step_time(8, 0, 0)


def test_a_pass_pays_each_draft_token_at_its_own_cost_and_for_the_mean_proposed() -> None:
    spec = SpecDecoding(draft_tokens=4, accept_len=2.0, draft_s=0.01, pass_s=0.3)
    # token_s None: a draft token costs what a decoded sequence does (the model before it).
    same = make_profile(replace(spec, token_s=PER_SEQ))
    assert same.step_time(3, 0, 50) == pytest.approx(make_profile(spec).step_time(3, 0, 50))
    # A token of its own cost, and drafts cut to 1.5 tokens a pass on average.
    cut = make_profile(replace(spec, token_s=0.002, drafted=1.5))
    verify = BASE + 0.3 + (PER_SEQ + 0.01 + 0.002 * 1.5) * 3 + PER_KV * 50
    assert cut.step_time(3, 0, 50) == pytest.approx(verify / 2.0)
    # The counters: every pass proposes the mean.
    assert cut.spec.counters(40) == (20, 30, 20)  # type: ignore[union-attr]
    assert "1.5 proposed on average" in cut.spec.describe()  # type: ignore[union-attr]


def test_with_spec_turns_it_on_and_off() -> None:
    spec = SpecDecoding(draft_tokens=4, accept_len=2.0)
    on = make_profile().with_spec(spec)
    assert on.spec == spec and on.with_spec(None).spec is None
    assert on.step_time(1, 0, 10) < make_profile().step_time(1, 0, 10)


def test_speculation_pays_up_to_the_batch_where_a_pass_stops_saving_bases() -> None:
    # A pass saves accept_len - 1 = 1 step base (1.0) less pass_s (0.25) on any batch and costs
    # each sequence 2 draft tokens (0.2) against the 0.1 that decoding a token more saves it:
    # 0.1 b < 0.75, so it pays up to b = 7 and not at 8 (the profile's max_num_seqs).
    spec = SpecDecoding(draft_tokens=4, accept_len=2.0, drafted=2.0, token_s=0.1, pass_s=0.25)
    profile = make_engine_profile(spec=spec)
    assert profile.spec_pays_up_to() == 7
    on, off = profile.with_spec(replace(spec, max_batch=0)), profile.with_spec(None)
    assert on.step_time(7, 0, 0) < off.step_time(7, 0, 0)
    assert on.step_time(8, 0, 0) > off.step_time(8, 0, 0)
    # The profile's own max_batch does not enter: it is what the answer is for.
    assert profile.with_spec(replace(spec, max_batch=2)).spec_pays_up_to() == 7
    # A context is read once a pass, for accept_len tokens: 100 tokens a sequence make the
    # extra cost of a sequence 0, so it pays in every step.
    assert profile.spec_pays_up_to(context_tokens=100) == profile.max_num_seqs
    # Cheap draft tokens (a GPU's, a CPU with native bfloat16): every step.
    assert profile.with_spec(replace(spec, token_s=0.01)).spec_pays_up_to() == 8
    # A speculative path that costs the whole base it saves: not even a lone sequence.
    assert profile.with_spec(replace(spec, pass_s=1.0)).spec_pays_up_to() == 0
    with pytest.raises(ValueError, match="needs a spec table"):
        make_engine_profile().spec_pays_up_to()
    with pytest.raises(ValueError, match=r"context_tokens \(-1\) must be >= 0"):
        profile.spec_pays_up_to(context_tokens=-1)


def test_the_engine_decodes_a_lone_sample_faster_and_counts_its_speculating_steps() -> None:
    spec = SpecDecoding(draft_tokens=4, accept_len=2.0, max_batch=1)

    finished: dict[str, int] = {}

    def run(profile: CostProfile) -> tuple[float, SimEngine]:
        engine = SimEngine("e", profile)
        engine.add(SimRequest("a", prompt_len=8, output_len=40, max_tokens=64))
        engine.add(SimRequest("b", prompt_len=8, output_len=10, max_tokens=64))
        busy = 0.0
        while engine.has_work():
            result = engine.step()
            busy += result.duration_s
            finished.update((f.request_id, f.spec_steps) for f in result.finished)
        return busy, engine

    plain_s, plain = run(make_profile())
    assert finished == {"a": 0, "b": 0}
    spec_s, fast = run(make_profile(spec))
    assert finished == {"a": 30, "b": 0}  # each sample's own speculating steps
    assert plain.stats.spec_steps == 0
    # Both samples run together for 9 decode steps (no speculation at 2 sequences); "a" then
    # decodes 30 tokens alone, speculating.
    assert fast.stats.spec_steps == 30
    assert fast.stats.generated_tokens == plain.stats.generated_tokens == 50
    assert spec_s < plain_s
    alone = [(BASE + PER_SEQ + PER_KV * (8 + t)) for t in range(10, 40)]
    spec_alone = [(BASE + PER_SEQ * 5 + PER_KV * (8 + t)) / 2.0 for t in range(10, 40)]
    assert plain_s - spec_s == pytest.approx(sum(alone) - sum(spec_alone))


def test_each_sequence_may_bring_its_own_acceptance_and_a_step_takes_their_mean() -> None:
    # Two samples decode together in every speculating step: one at 1.5 tokens a pass (a
    # prompt new to the engine), one at 3.5 (its history is here); the step is 1 / 2.5 of a
    # pass, as a profile whose accept_len is their mean would make it.
    spec = SpecDecoding(draft_tokens=4, accept_len=2.0, accept_by_history=(1.5, 2.5, 3.5))
    assert [spec.accept_for(h) for h in (0, 1, 2, 9)] == [1.5, 2.5, 3.5, 3.5]
    assert "1.5/2.5/3.5 tokens a pass" in spec.describe()
    # counted by outputs, 4 to a step: 3 outputs of 2 groups are no step, 8 of 1 are two
    by_outputs = replace(spec, history_outputs=4)
    assert [by_outputs.accept_for(g, o) for g, o in ((2, 3), (1, 4), (1, 8), (5, 40))] == [
        1.5,
        2.5,
        3.5,
        3.5,
    ]
    assert "x 4 earlier outputs" in by_outputs.describe()

    def busy(profile: CostProfile, accepts: tuple[float | None, float | None]) -> float:
        engine = SimEngine("e", profile)
        for name, accept in zip("ab", accepts, strict=True):
            engine.add(
                SimRequest(name, prompt_len=8, output_len=20, max_tokens=64, accept_len=accept)
            )
        total = 0.0
        while engine.has_work():
            total += engine.step().duration_s
        return total

    mixed = busy(make_profile(spec), (1.5, 3.5))
    assert mixed == pytest.approx(busy(make_profile(replace(spec, accept_len=2.5)), (None, None)))
    assert mixed < busy(make_profile(spec), (None, None))  # the profile's 2.0 for both
    with pytest.raises(ValueError, match=r"accept_len \(6.0\) must be between 1 and 5"):
        SimEngine("e", make_profile(spec)).add(
            SimRequest("c", prompt_len=8, output_len=5, max_tokens=8, accept_len=6.0)
        )


PROFILE_LINES = [
    'name = "mine"',
    'source = "made up"',
    'simulated_hardware = "none"',
    "step_base_s = 0.01",
    "per_decode_seq_s = 0.0",
    "per_prefill_token_s = 0.0",
    "per_kv_token_s = 0.0",
    "kv_capacity_tokens = 1024",
    "block_size = 16",
    "max_num_seqs = 8",
    "max_num_batched_tokens = 512",
]


def test_a_profile_file_may_hold_a_spec_table(tmp_path: Path) -> None:
    path = tmp_path / "p.toml"
    path.write_text("\n".join([*PROFILE_LINES, "[spec]", "draft_tokens = 4", "accept_len = 2"]))
    profile = load_profile(path)
    assert profile.spec == SpecDecoding(draft_tokens=4, accept_len=2.0)
    path.write_text(
        "\n".join(
            [*PROFILE_LINES, "[spec]", "draft_tokens = 4", "accept_len = 2", "pass_s = 0.0015"]
        )
    )
    assert load_profile(path).spec == SpecDecoding(draft_tokens=4, accept_len=2.0, pass_s=0.0015)
    # the costs `sim calibrate-spec` fits, and a drafter's mean cut draft
    fitted = ["token_s = 5.4e-5", "drafted = 2.3", "draft_s = 3e-5"]
    path.write_text(
        "\n".join([*PROFILE_LINES, "[spec]", "draft_tokens = 4", "accept_len = 2", *fitted])
    )
    assert load_profile(path).spec == SpecDecoding(
        draft_tokens=4, accept_len=2.0, token_s=5.4e-5, drafted=2.3, draft_s=3e-5
    )
    path.write_text("\n".join(PROFILE_LINES))
    assert load_profile(path).spec is None


@pytest.mark.parametrize(
    ("table", "message"),
    [
        (["draft_tokens = 4", "accept_len = 2", "lookahead = 3"], r"unknown keys in \[spec\]"),
        (["draft_tokens = 4"], r"\[spec\] misses accept_len"),
        (["draft_tokens = 4.5", "accept_len = 2"], r"draft_tokens must be an integer"),
        (["draft_tokens = 4", 'accept_len = "2"'], r"accept_len must be a number"),
        (["draft_tokens = 4", "accept_len = 9"], r"accept_len \(9\) must be between"),
        (["draft_tokens = 4", "accept_len = 2", 'token_s = "fast"'], r"token_s must be a number"),
        (
            ["draft_tokens = 4", "accept_len = 3", "drafted = 1.5"],
            r"accept_len \(3\) must be between 1 and drafted \+ 1 \(2.5\)",
        ),
    ],
)
def test_a_bad_spec_table_is_an_error_that_names_the_file(
    tmp_path: Path, table: list[str], message: str
) -> None:
    path = tmp_path / "p.toml"
    path.write_text("\n".join([*PROFILE_LINES, "[spec]", *table]))
    with pytest.raises(ValueError, match=message) as info:
        load_profile(path)
    assert str(path) in str(info.value)


SCENARIO = """
name = "tiny"
description = "a few groups with a long tail, for tests"
profile = "gpu-h100-llama8b"
engines = 2
groups_per_step = 8
n = 4
steps = 1
prompts = 8
prompt_len_median = 100
prompt_len_sigma = 0.3
shared_prefix_len = 0
prefix_pool = 1
response_median = 200
prompt_sigma = 0.9
within_sigma = 0.6
drift_sigma = 0.0
max_tokens = 4096
seed = 3
"""


def test_bench_rows_with_spec_run_on_speculating_engines(tmp_path: Path) -> None:
    scenario = tmp_path / "tiny.toml"
    scenario.write_text(SCENARIO)
    spec = SpecDecoding(draft_tokens=4, accept_len=2.0, max_batch=8)
    out = run_policies(
        PoliciesConfig(
            scenario=str(scenario),
            policies=("round_robin", "round_robin+spec", "rl+spec"),
            spec=spec,
            out_dir=tmp_path / "out",
            json_path=tmp_path / "out.json",
        ),
        Console(file=open(tmp_path / "log.txt", "w"), width=190),  # noqa: SIM115
    )
    rows = out["policies"]
    assert not rows["round_robin"]["speculating"] and rows["round_robin"]["spec_steps"] == 0
    assert rows["round_robin+spec"]["speculating"] and rows["round_robin+spec"]["spec_steps"] > 0
    # The same placement on speculating engines: the tail decodes faster.
    assert rows["round_robin+spec"]["makespan_s"] < rows["round_robin"]["makespan_s"]
    assert rows["round_robin+spec"]["vs_round_robin"] > 1
    assert out["step_floor_spec_s"] < out["step_floor_s"]
    assert out["spec"]["accept_len"] == 2.0
    pays = out["spec"]["pays_up_to"]
    assert pays == load_profile("gpu-h100-llama8b").with_spec(spec).spec_pays_up_to()
    log = (tmp_path / "log.txt").read_text()
    assert f"plain decoding in steps of up to {pays} sequences (--spec-max-batch {pays})" in log
    assert json.loads((tmp_path / "out.json").read_text())["spec"]["rows"] == [
        "round_robin+spec",
        "rl+spec",
    ]


def test_bench_rows_with_spec_need_the_spec(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"rl\+spec run on engines that speculate.*--spec-accept"):
        run_policies(PoliciesConfig(policies=("rl", "rl+spec"), out_dir=tmp_path))


def test_engine_counters_of_speculation_follow_the_mean_accepted_length() -> None:
    spec = SpecDecoding(draft_tokens=4, accept_len=2.5, max_batch=2)
    engine = SimEngine("e", make_profile(spec))
    engine.add(SimRequest("a", prompt_len=8, output_len=40, max_tokens=64))
    while engine.has_work():
        engine.step()
    # The prompt's step samples the first token; 39 decode steps of one sequence follow.
    assert engine.stats.spec_seq_steps == 39
    drafts, draft_tokens, accepted = engine.stats.spec_counters(spec)
    assert (drafts, draft_tokens, accepted) == (16, 64, 23)  # 39 / 2.5 passes, 1.5 accepted each
    assert engine.stats.spec_counters(None) == (0, 0, 0)


async def test_a_sim_engine_on_a_speculating_profile_reports_its_drafts(tmp_path: Path) -> None:
    path = tmp_path / "spec.toml"
    text = load_profile("gpu-h100-llama8b")
    lines = [
        f'name = "{text.name}-spec"',
        'source = "the shipped H100 profile with speculation, for a test"',
        f'simulated_hardware = "{text.simulated_hardware}"',
        *(
            f"{name} = {getattr(text, name)!r}"
            for name in (
                "step_base_s",
                "per_decode_seq_s",
                "per_prefill_token_s",
                "per_kv_token_s",
                "kv_capacity_tokens",
                "block_size",
                "max_num_seqs",
                "max_num_batched_tokens",
            )
        ),
        "[spec]",
        "draft_tokens = 4",
        "accept_len = 2.0",
        "max_batch = 8",
    ]
    path.write_text("\n".join(lines))
    async with sim_engine(profile=str(path)) as (_, stub):
        _, completes, _ = await collect(stub.Generate(generate_request(n=4)))
        stats = await stub.Stats(pb.StatsRequest())
    # Each sample's Complete carries its own share (accept_len 2: one accepted of 4 a pass);
    # rounded per sample, they add up to the engine's counts within a draft a sample.
    proposed = [c.spec_draft_tokens for c in completes.values()]
    accepted = [c.spec_accepted_tokens for c in completes.values()]
    assert all(p == 4 * a for p, a in zip(proposed, accepted, strict=True))
    # one draft of 4 tokens a pass: as many passes as a quarter of the draft tokens
    assert all(c.spec_drafts * 4 == c.spec_draft_tokens for c in completes.values())
    assert abs(sum(c.spec_drafts for c in completes.values()) - stats.spec_drafts) <= len(completes)
    assert abs(sum(proposed) - stats.spec_draft_tokens) <= 4 * len(completes)
    assert sum(accepted) > 0
    assert stats.spec_drafts > 0
    assert stats.spec_draft_tokens == 4 * stats.spec_drafts
    assert stats.spec_accepted_tokens == stats.spec_drafts  # accept_len 2: one draft token a pass
    async with sim_engine() as (_, stub):
        await collect(stub.Generate(generate_request(n=4)))
        plain = await stub.Stats(pb.StatsRequest())
    assert (plain.spec_drafts, plain.spec_draft_tokens, plain.spec_accepted_tokens) == (0, 0, 0)


def test_bench_names_unknown_policies_and_the_known_ones(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"policies \['rl\+speck'\] unknown; known: .*oracle"):
        run_policies(PoliciesConfig(policies=("rl", "rl+speck"), out_dir=tmp_path))


def test_without_round_robin_its_ratios_are_null_not_nan(tmp_path: Path) -> None:
    """A run that leaves round_robin out has no reference: the JSON says null (NaN is not
    JSON) and the table a dash."""
    scenario = tmp_path / "tiny.toml"
    scenario.write_text(SCENARIO)
    log = tmp_path / "log.txt"
    with log.open("w") as file:
        run_policies(
            PoliciesConfig(
                scenario=str(scenario),
                policies=("rl",),
                out_dir=tmp_path / "out",
                json_path=tmp_path / "out.json",
            ),
            Console(file=file, width=190),
        )
    text = (tmp_path / "out.json").read_text()
    assert "NaN" not in text
    report = json.loads(text)
    assert report["policies"]["rl"]["vs_round_robin"] is None
    assert report["max_vs_sync_round_robin"] is None
    assert "nan" not in log.read_text()


def test_each_samples_speculating_steps_add_up_to_the_engines_through_preemptions() -> None:
    """Twelve samples on an engine whose KV runs out (preemptions) and that speculates at up to
    four sequences: every sample's count of speculating steps, carried across its preemptions,
    sums to the engine's sequence-steps of speculation."""
    spec = SpecDecoding(draft_tokens=4, accept_len=2.0, max_batch=4)
    engine = SimEngine("e", make_engine_profile(kv_capacity_tokens=256, spec=spec))
    for i in range(12):
        engine.add(SimRequest(f"r{i}", prompt_len=8, output_len=10 + 7 * i, max_tokens=128))
    finished: list[Finished] = []
    while engine.has_work():
        finished += engine.step().finished
    assert len(finished) == 12 and engine.stats.preemptions > 0
    assert sum(f.preemptions for f in finished) == engine.stats.preemptions
    assert sum(f.spec_steps for f in finished) == engine.stats.spec_seq_steps > 0
