"""The simulated vLLM engine and its cost profiles, on hand-built profiles (no files, no time)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from rollserve.engine.cpu_features import cpu_model
from rollserve.sim.engine_model import Finished, SimEngine, SimRequest, StepResult
from rollserve.sim.profile import (
    CostProfile,
    cpu_profile_name,
    load_profile,
    profile_names,
)

# Round coefficients so that a step's time can be written down by hand.
BASE, PER_SEQ, PER_PREFILL, PER_KV = 1.0, 0.1, 0.01, 0.001


def make_profile(**overrides: Any) -> CostProfile:
    profile = CostProfile(
        name="test",
        source="hand-made for tests",
        simulated_hardware="none",
        step_base_s=BASE,
        per_decode_seq_s=PER_SEQ,
        per_prefill_token_s=PER_PREFILL,
        per_kv_token_s=PER_KV,
        kv_capacity_tokens=1024,
        block_size=4,
        max_num_seqs=8,
        max_num_batched_tokens=256,
    )
    return replace(profile, **overrides)


def request(
    rid: str,
    *,
    prompt_len: int = 10,
    output_len: int = 5,
    max_tokens: int = 16,
    prefix_id: str = "",
    prefix_len: int = 0,
    priority: int = 0,
) -> SimRequest:
    return SimRequest(rid, prompt_len, output_len, max_tokens, prefix_id, prefix_len, priority)


def drain(engine: SimEngine, limit: int = 10_000) -> list[StepResult]:
    results: list[StepResult] = []
    while engine.has_work():
        assert len(results) < limit, "engine did not drain"
        results.append(engine.step())
        assert engine.kv_used_tokens <= engine.kv_capacity_tokens
    return results


def finished_of(results: list[StepResult]) -> dict[str, Finished]:
    return {f.request_id: f for r in results for f in r.finished}


def test_single_request_runs_output_len_steps_at_the_cost_formula() -> None:
    engine = SimEngine("e0", make_profile())
    engine.add(request("r", prompt_len=10, output_len=5))
    results = drain(engine)

    assert len(results) == 5
    first = results[0]
    assert (first.decode_seqs, first.prefill_tokens) == (0, 10)
    assert first.duration_s == pytest.approx(BASE + 10 * PER_PREFILL)
    for k, result in enumerate(results[1:], start=1):
        # Decoding token k+1 attends the prompt and the k tokens generated so far.
        assert (result.decode_seqs, result.prefill_tokens) == (1, 0)
        assert result.duration_s == pytest.approx(BASE + PER_SEQ + (10 + k) * PER_KV)
    assert results[-1].finished == (Finished("r", 5, "stop", 0, 0),)
    assert all(not r.finished for r in results[:-1])
    assert engine.stats.steps == 5
    assert engine.stats.generated_tokens == 5
    assert engine.stats.busy_s == pytest.approx(sum(r.duration_s for r in results))
    assert engine.kv_used_tokens == 0


def test_progress_counts_the_first_token_in_the_prefill_step() -> None:
    engine = SimEngine("e0", make_profile())
    engine.add(request("r", output_len=3))
    assert engine.progress("r") == 0
    engine.step()
    assert engine.progress("r") == 1
    engine.step()
    assert engine.progress("r") == 2
    assert engine.progress("unknown") == 0


def test_finish_reason_stop_within_max_tokens_and_length_beyond() -> None:
    engine = SimEngine("e0", make_profile())
    engine.add(request("long", output_len=20, max_tokens=6))
    engine.add(request("exact", output_len=6, max_tokens=6))
    engine.add(request("short", output_len=2, max_tokens=6))
    done = finished_of(drain(engine))
    assert (done["long"].output_tokens, done["long"].finish_reason) == (6, "length")
    assert (done["exact"].output_tokens, done["exact"].finish_reason) == (6, "stop")
    assert (done["short"].output_tokens, done["short"].finish_reason) == (2, "stop")


def test_requests_added_together_prefill_and_decode_in_the_same_steps() -> None:
    engine = SimEngine("e0", make_profile())
    engine.add(request("a", prompt_len=10, output_len=4))
    engine.add(request("b", prompt_len=6, output_len=4))
    results = drain(engine)
    assert len(results) == 4
    assert (results[0].decode_seqs, results[0].prefill_tokens) == (0, 16)
    assert [r.decode_seqs for r in results[1:]] == [2, 2, 2]
    # Second step: a attends 10 + 1 tokens, b 6 + 1.
    assert results[1].duration_s == pytest.approx(BASE + 2 * PER_SEQ + 18 * PER_KV)
    assert {f.request_id for f in results[-1].finished} == {"a", "b"}


def test_max_num_seqs_caps_the_running_batch() -> None:
    engine = SimEngine("e0", make_profile(max_num_seqs=2))
    for rid, out in (("a", 2), ("b", 5), ("c", 3)):
        engine.add(request(rid, output_len=out))
    engine.step()
    assert (engine.running, engine.waiting) == (2, 1)
    second = engine.step()
    assert [f.request_id for f in second.finished] == ["a"]
    third = engine.step()  # c is admitted into a's place
    assert (third.decode_seqs, third.prefill_tokens) == (1, 10)
    assert (engine.running, engine.waiting) == (2, 0)
    results = [second, third, *drain(engine)]
    assert all(r.decode_seqs <= 2 for r in results)
    assert set(finished_of(results)) == {"a", "b", "c"}


def test_token_budget_limits_admission_but_an_empty_step_takes_a_long_prompt() -> None:
    engine = SimEngine("e0", make_profile(max_num_batched_tokens=15))
    engine.add(request("a", prompt_len=10, output_len=3))
    engine.add(request("b", prompt_len=10, output_len=3))
    first = engine.step()
    assert (first.prefill_tokens, engine.running, engine.waiting) == (10, 1, 1)

    alone = SimEngine("e1", make_profile(max_num_batched_tokens=15))
    alone.add(request("big", prompt_len=40, output_len=2))
    assert alone.step().prefill_tokens == 40


def test_lower_priority_value_is_admitted_first() -> None:
    engine = SimEngine("e0", make_profile(max_num_seqs=1))
    engine.add(request("late", output_len=1, priority=1))
    engine.add(request("urgent", output_len=1, priority=0))
    engine.add(request("urgent2", output_len=1, priority=0))
    order = [f.request_id for r in drain(engine) for f in r.finished]
    assert order == ["urgent", "urgent2", "late"]


def test_prefix_cache_serves_whole_blocks_of_a_shared_prefix() -> None:
    engine = SimEngine("e0", make_profile(block_size=4))
    engine.add(request("a0", prompt_len=10, output_len=3, prefix_id="a", prefix_len=10))
    engine.step()
    engine.add(request("a1", prompt_len=10, output_len=3, prefix_id="a", prefix_len=10))
    engine.add(request("b0", prompt_len=10, output_len=3, prefix_id="b", prefix_len=10))
    engine.add(request("none", prompt_len=10, output_len=3))
    admitting = engine.step()
    # a1 reuses the 2 whole blocks (8 tokens) of a's prefix; b0 and none share nothing.
    assert admitting.prefill_tokens == (10 - 8) + 10 + 10
    done = finished_of([admitting, *drain(engine)])
    assert done["a0"].cached_prompt_tokens == 0
    assert done["a1"].cached_prompt_tokens == 8
    assert done["b0"].cached_prompt_tokens == 0
    assert done["none"].cached_prompt_tokens == 0
    assert engine.stats.prompt_tokens == 40
    assert engine.stats.cached_prompt_tokens == 8


def test_siblings_admitted_in_one_step_share_the_prefix_and_its_blocks() -> None:
    engine = SimEngine("e0", make_profile(block_size=4))
    for i in range(4):
        engine.add(request(f"s{i}", prompt_len=12, output_len=2, prefix_id="p", prefix_len=12))
    first = engine.step()
    # The prompt's last token is always computed: 2 whole blocks are shareable, not 3.
    assert first.prefill_tokens == 12 + 3 * (12 - 8)
    # 2 shared blocks once, plus 2 private blocks each for tokens 9..13.
    assert engine.kv_used_tokens == (2 + 4 * 2) * 4
    done = finished_of(drain(engine))
    assert [done[f"s{i}"].cached_prompt_tokens for i in range(4)] == [0, 8, 8, 8]


def test_unreferenced_cached_blocks_are_evicted_lru_tail_first() -> None:
    engine = SimEngine("e0", make_profile(block_size=4, kv_capacity_tokens=32))  # 8 blocks
    engine.add(request("a", prompt_len=9, output_len=1, max_tokens=4, prefix_id="a", prefix_len=9))
    engine.add(request("b", prompt_len=9, output_len=1, max_tokens=4, prefix_id="b", prefix_len=9))
    drain(engine)
    # Both finished; their 2-block prefixes stay cached, unreferenced.
    assert engine.kv_used_tokens == 0
    # 5 blocks needed, 4 free: the least recently released block goes, the tail of a's prefix.
    engine.add(request("c", prompt_len=16, output_len=1, max_tokens=4))
    drain(engine)
    engine.add(request("a2", prompt_len=9, output_len=1, max_tokens=4, prefix_id="a", prefix_len=9))
    engine.add(request("b2", prompt_len=9, output_len=1, max_tokens=4, prefix_id="b", prefix_len=9))
    done = finished_of(drain(engine))
    assert done["a2"].cached_prompt_tokens == 4
    assert done["b2"].cached_prompt_tokens == 8


def test_kv_pressure_preempts_the_newest_and_every_request_still_finishes() -> None:
    engine = SimEngine("e0", make_profile(block_size=4, kv_capacity_tokens=64))  # 16 blocks
    for i in range(4):
        engine.add(request(f"r{i}", prompt_len=8, output_len=20, max_tokens=24))
    results = drain(engine)

    first_preemption = next(r for r in results if r.preempted)
    assert first_preemption.preempted == ("r3",)  # the most recently admitted
    done = finished_of(results)
    assert set(done) == {f"r{i}" for i in range(4)}
    for f in done.values():
        assert (f.output_tokens, f.finish_reason) == (20, "stop")
    stats = engine.stats
    assert stats.preemptions > 0
    assert stats.preemptions == sum(f.preemptions for f in done.values())
    assert stats.preemptions == sum(len(r.preempted) for r in results)
    assert stats.recomputed_tokens > 0
    assert stats.generated_tokens == 80
    assert stats.prompt_tokens == 32  # first admissions only
    assert sum(r.prefill_tokens for r in results) == 32 + stats.recomputed_tokens
    assert engine.kv_used_tokens == 0


def test_a_preempted_request_resumes_with_its_tokens_before_later_arrivals() -> None:
    # 8 blocks; a budget of 20 tokens lets one resumed request prefill per step.
    profile = make_profile(block_size=4, kv_capacity_tokens=32, max_num_batched_tokens=20)
    engine = SimEngine("e0", profile)
    engine.add(request("old", prompt_len=8, output_len=20, max_tokens=24))
    engine.add(request("new", prompt_len=8, output_len=20, max_tokens=24))
    results: list[StepResult] = []
    while not any(r.preempted for r in results):
        results.append(engine.step())
    assert results[-1].preempted == ("new",)
    kept = engine.progress("new")
    assert kept > 0
    assert (engine.running, engine.waiting) == (1, 1)
    engine.add(request("later", prompt_len=8, output_len=1, max_tokens=24))
    rest = drain(engine)
    # new goes first and prefills its prompt plus the tokens it had generated; later follows.
    assert [r.prefill_tokens for r in rest if r.prefill_tokens] == [8 + kept, 8]
    assert engine.stats.recomputed_tokens == 8 + kept
    done = finished_of(rest)
    assert (done["new"].output_tokens, done["new"].preemptions) == (20, 1)
    assert (done["later"].output_tokens, done["later"].preemptions) == (1, 0)


def test_abort_returns_progress_and_frees_blocks() -> None:
    engine = SimEngine("e0", make_profile())
    engine.add(request("r", prompt_len=10, output_len=50, max_tokens=64))
    engine.add(request("w", prompt_len=10, output_len=5))
    for _ in range(3):
        engine.step()
    assert engine.kv_used_tokens > 0
    assert engine.abort("r") == Finished("r", 3, "abort", 0, 0)
    assert engine.progress("r") == 0
    assert engine.abort("r") is None
    assert engine.abort("nope") is None
    assert engine.abort("w") == Finished("w", 3, "abort", 0, 0)
    assert engine.kv_used_tokens == 0
    assert not engine.has_work()

    queued = SimEngine("e1", make_profile())
    queued.add(request("q"))
    assert queued.abort("q") == Finished("q", 0, "abort", 0, 0)
    assert (queued.waiting, queued.running) == (0, 0)


def test_add_rejects_duplicates_and_requests_beyond_capacity() -> None:
    engine = SimEngine("e0", make_profile(kv_capacity_tokens=64))
    engine.add(request("r"))
    with pytest.raises(ValueError, match="already"):
        engine.add(request("r"))
    with pytest.raises(ValueError, match=r"prompt_len \(40\) \+ max_tokens \(30\)"):
        engine.add(request("big", prompt_len=40, max_tokens=30))
    with pytest.raises(ValueError, match=r"max_tokens \(0\)"):
        engine.add(request("zero", max_tokens=0))
    with pytest.raises(ValueError, match="prefix_len"):
        engine.add(request("p", prompt_len=4, prefix_id="x", prefix_len=5))


def test_same_inputs_give_the_same_steps() -> None:
    def run() -> list[StepResult]:
        engine = SimEngine("e0", make_profile(kv_capacity_tokens=64))
        for i in range(6):
            engine.add(request(f"r{i}", prompt_len=6 + i, output_len=10 + 3 * i, max_tokens=30))
        return drain(engine)

    assert run() == run()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"block_size": 0}, r"block_size \(0\) must be at least 1"),
        ({"max_num_seqs": 0}, r"max_num_seqs \(0\) must be at least 1"),
        ({"max_num_batched_tokens": -1}, r"max_num_batched_tokens \(-1\) must be at least 1"),
        ({"step_base_s": 0.0}, r"step_base_s \(0.0\) must be greater than 0"),
        ({"per_kv_token_s": -1e-9}, r"per_kv_token_s \(-1e-09\) must be at least 0"),
        ({"kv_capacity_tokens": 3}, r"kv_capacity_tokens \(3\) must be at least one block"),
        ({"source": " "}, "source must not be empty"),
        ({"weights_load_s": -0.5}, r"weights_load_s \(-0.5\) must be at least 0"),
    ],
)
def test_profile_validation_names_the_field(
    overrides: dict[str, int | float | str], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        make_profile(**overrides)


def test_step_time_is_the_linear_cost_model() -> None:
    profile = make_profile()
    assert profile.step_time(3, 20, 100) == pytest.approx(
        BASE + 3 * PER_SEQ + 20 * PER_PREFILL + 100 * PER_KV
    )
    with pytest.raises(ValueError, match="decode_seqs"):
        profile.step_time(-1, 0, 0)


def test_shipped_profiles_load() -> None:
    names = profile_names()
    assert {"gpu-h100-llama8b", "cpu-tiny", "cpu-tiny-avx2"} <= set(names)
    for name in names:
        profile = load_profile(name)
        assert profile.name == name
        assert profile.source and profile.simulated_hardware
    for name in ("cpu-tiny", "cpu-tiny-avx2"):
        assert "rollserve sim calibrate" in load_profile(name).source  # calibrated here
    # With AVX2 alone the engine runs the reasoner in float32, not emulated bfloat16 (which
    # cost 4.5 times native bfloat16's 91 µs a decoding sequence): about as much as native.
    native, avx2 = load_profile("cpu-tiny"), load_profile("cpu-tiny-avx2")
    assert "float32" in avx2.simulated_hardware and "bfloat16" in native.simulated_hardware
    assert avx2.per_decode_seq_s < 2 * native.per_decode_seq_s
    gpu = load_profile("gpu-h100-llama8b")
    assert 5e-3 < gpu.step_time(1, 0, 1000) < 10e-3  # one stream decodes at 100-200 tokens/s


MINE = (
    'name = "mine"',
    'source = "made up"',
    'simulated_hardware = "none"',
    "step_base_s = 1",
    "per_decode_seq_s = 0.5",
    "per_prefill_token_s = 0.0",
    "per_kv_token_s = 0.0",
    "kv_capacity_tokens = 64",
    "block_size = 16",
    "max_num_seqs = 4",
    "max_num_batched_tokens = 128",
)
"""A profile's TOML lines, every field given."""


def test_load_profile_reads_a_path_and_rejects_unknown_and_missing_keys(tmp_path: Path) -> None:
    lines = list(MINE)
    good = tmp_path / "mine.toml"
    good.write_text("\n".join(lines))
    assert load_profile(good) == make_profile(
        name="mine",
        source="made up",
        simulated_hardware="none",
        step_base_s=1.0,
        per_decode_seq_s=0.5,
        per_prefill_token_s=0.0,
        per_kv_token_s=0.0,
        kv_capacity_tokens=64,
        block_size=16,
        max_num_seqs=4,
        max_num_batched_tokens=128,
    )
    assert load_profile(str(good)).name == "mine"

    extra = tmp_path / "extra.toml"
    extra.write_text("\n".join([*lines, "gpu_count = 2"]))
    with pytest.raises(ValueError, match=r"extra\.toml: unknown keys \['gpu_count'\]"):
        load_profile(extra)

    short = tmp_path / "short.toml"
    short.write_text("\n".join(line for line in lines if not line.startswith("block_size")))
    with pytest.raises(ValueError, match=r"short\.toml: missing keys \['block_size'\]"):
        load_profile(short)

    wrong = tmp_path / "wrong.toml"
    wrong.write_text("\n".join(lines).replace("block_size = 16", "block_size = 16.5"))
    with pytest.raises(ValueError, match="block_size must be an integer"):
        load_profile(wrong)

    with pytest.raises(ValueError, match="no shipped profile"):
        load_profile("no-such-profile")


def test_weights_load_s_is_optional_and_a_number(tmp_path: Path) -> None:
    path = tmp_path / "p.toml"
    path.write_text("\n".join(MINE))
    assert load_profile(path).weights_load_s == 0.0
    path.write_text("\n".join([*MINE, "weights_load_s = 2"]))
    assert load_profile(path).weights_load_s == 2.0
    path.write_text("\n".join([*MINE, 'weights_load_s = "slow"']))
    with pytest.raises(ValueError, match="weights_load_s must be a number of seconds"):
        load_profile(path)
    assert load_profile("cpu-tiny").weights_load_s > 0  # both shipped profiles model it
    assert load_profile("gpu-h100-llama8b").weights_load_s > 0


def test_new_weights_recompute_the_running_and_empty_the_prefix_cache() -> None:
    engine = SimEngine("e0", make_profile(block_size=4, kv_capacity_tokens=400))
    for i in range(2):
        engine.add(request(f"r{i}", prompt_len=12, output_len=6, prefix_id="p", prefix_len=12))
    first = engine.step()  # both admitted; the second hits the first's prefix blocks
    engine.step()
    # The last prompt token is always computed: 2 blocks of 4 shared, the second prefills 4.
    assert (first.prefill_tokens, engine.running) == (12 + 4, 2)
    assert engine.new_weights() == 2
    assert (engine.running, engine.waiting, engine.kv_used_tokens) == (0, 2, 0)
    assert [engine.progress(f"r{i}") for i in range(2)] == [2, 2]  # tokens kept
    again = engine.step()
    # Both prefill prompt + the 2 tokens each made again: the first all 14 (the cache was
    # emptied; else it would hit 8), the second 14 - 8 (the first registered them again).
    assert again.prefill_tokens == 14 + 6
    assert engine.stats.recomputed_tokens == 14 + 6
    assert engine.stats.weight_updates == 1
    rest = drain(engine)
    assert sorted(f.output_tokens for r in [again, *rest] for f in r.finished) == [6, 6]


@pytest.mark.parametrize("chunked", [False, True])
def test_a_prompt_over_the_budget_waits_for_an_empty_step_unless_prefill_is_chunked(
    chunked: bool,
) -> None:
    engine = SimEngine("e0", make_profile(max_num_batched_tokens=16, chunked_prefill=chunked))
    engine.add(request("short", prompt_len=4, output_len=5))
    engine.step()  # "short" decodes from now on
    engine.add(request("long", prompt_len=40, output_len=2))
    step = engine.step()
    # Chunked: admitted beside the decode, its whole prefill charged to this step (vLLM would
    # spread it over three); else it waits until "short" is done.
    assert (step.decode_seqs, step.prefill_tokens) == ((1, 40) if chunked else (1, 0))
    rest = drain(engine)
    assert sum(r.prefill_tokens for r in rest) == (0 if chunked else 40)


def test_calibrated_engines_is_optional_and_checked(tmp_path: Path) -> None:
    """A profile from published figures has no engine count; a calibrated one says how many
    engines shared the host, and a count below 1 or not a whole number is refused."""
    lines = list(MINE)
    path = tmp_path / "p.toml"
    path.write_text("\n".join(lines))
    assert load_profile(path).calibrated_engines is None
    path.write_text("\n".join([*lines, "calibrated_engines = 2"]))
    assert load_profile(path).calibrated_engines == 2
    path.write_text("\n".join([*lines, "calibrated_engines = 0"]))
    with pytest.raises(ValueError, match=r"calibrated_engines \(0\) must be at least 1"):
        load_profile(path)
    path.write_text("\n".join([*lines, "calibrated_engines = 1.5"]))
    with pytest.raises(ValueError, match="calibrated_engines must be an integer"):
        load_profile(path)
    assert load_profile("gpu-h100-llama8b").calibrated_engines is None


@pytest.mark.parametrize(
    ("flags", "name"),
    [
        ("fpu sse2 avx avx2 fma avx512f avx512_bf16 amx_tile", "cpu-tiny"),
        ("fpu sse2 avx avx2 fma amx_bf16 amx_tile", "cpu-tiny"),
        ("fpu sse2 avx avx2 fma avx512f avx512bw avx512vl", "cpu-tiny-avx2"),
        ("fpu sse2 avx avx2 fma", "cpu-tiny-avx2"),
        (None, "cpu-tiny"),  # no flags line (another architecture): the default
    ],
)
def test_the_cpu_profile_is_the_one_fitted_on_a_cpu_like_this(flags: str | None, name: str) -> None:
    cpuinfo = "processor\t: 0\nmodel name\t: AMD EPYC\n" + (
        "" if flags is None else f"flags\t\t: {flags}\n"
    )
    assert cpu_profile_name(cpuinfo) == name
    assert cpu_model(cpuinfo) == "AMD EPYC"
    assert cpu_model("processor\t: 0\n") == ""
