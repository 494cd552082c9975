"""Speculative decoding settings of the engine: validation, the vLLM `speculative_config` built
from them, their flags (engine and `rollserve up`) and the Stats fields they feed. No engine
runs: vLLM is not imported; the Stats test uses a backend with fixed counters."""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path
from typing import Any, cast

import pytest
from pydantic import ValidationError
from rollserve.cli.main import build_parser as build_cli_parser
from rollserve.engine.server import parse_settings
from rollserve.engine.service import (
    EngineCounters,
    EngineServicer,
    GenerationBackend,
    ModelInfo,
    build_speculative_config,
)
from rollserve.engine.settings import (
    MAX_PROMPT_LOOKUP,
    MAX_SPECULATIVE_TOKENS,
    EngineSettings,
)
from rollserve.v1 import rollserve_pb2 as pb


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text("{}")
    return tmp_path


def settings(model_dir: Path, **values: Any) -> EngineSettings:
    return EngineSettings(model=model_dir, **values)


def error_of(model_dir: Path, **values: Any) -> str:
    with pytest.raises(ValidationError) as caught:
        settings(model_dir, **values)
    return str(caught.value)


# ---------------------------------------------------------------- validation


def test_speculation_is_off_by_default(model_dir: Path) -> None:
    plain = settings(model_dir)
    assert plain.spec_method is None
    assert build_speculative_config(plain) is None


@pytest.mark.parametrize(
    ("values", "field", "limit"),
    [
        ({"num_speculative_tokens": 0}, "num_speculative_tokens", "greater than or equal to 1"),
        (
            {"num_speculative_tokens": MAX_SPECULATIVE_TOKENS + 1},
            "num_speculative_tokens",
            f"less than or equal to {MAX_SPECULATIVE_TOKENS}",
        ),
        ({"prompt_lookup_min": 0}, "prompt_lookup_min", "greater than or equal to 1"),
        (
            {"prompt_lookup_max": MAX_PROMPT_LOOKUP + 1},
            "prompt_lookup_max",
            f"less than or equal to {MAX_PROMPT_LOOKUP}",
        ),
        ({"spec_max_batch": -1}, "spec_max_batch", "greater than or equal to 0"),
        (
            {"spec_method": "rollout", "spec_background_tokens": -1},
            "spec_background_tokens",
            "greater than or equal to 0",
        ),
        (
            {"spec_method": "rollout", "spec_history_tokens": 0},
            "spec_history_tokens",
            "greater than or equal to 1",
        ),
        (
            {"spec_method": "rollout", "spec_history_per_prompt": 1 << 17},
            "spec_history_per_prompt",
            f"less than or equal to {1 << 16}",
        ),
        ({"spec_method": "eagle"}, "spec_method", "'ngram', 'rollout' or 'suffix'"),
    ],
)
def test_each_bound_names_the_field_and_the_limit(
    model_dir: Path, values: dict[str, Any], field: str, limit: str
) -> None:
    message = error_of(model_dir, **{"spec_method": "ngram", **values})
    assert field in message
    assert limit in message


def test_lookup_min_above_max_is_refused(model_dir: Path) -> None:
    message = error_of(model_dir, spec_method="ngram", prompt_lookup_min=6, prompt_lookup_max=3)
    assert "prompt_lookup_min (6) exceeds prompt_lookup_max (3)" in message


def test_spec_max_batch_must_leave_some_batch_sizes_unspeculated(model_dir: Path) -> None:
    message = error_of(model_dir, spec_method="ngram", max_num_seqs=16, spec_max_batch=16)
    assert "spec_max_batch (16) must be below max_num_seqs (16)" in message
    assert "at most 15" in message
    assert settings(model_dir, spec_method="ngram", max_num_seqs=16, spec_max_batch=15)


@pytest.mark.parametrize(
    "field", ["num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "spec_max_batch"]
)
def test_speculative_settings_without_a_method_are_refused(model_dir: Path, field: str) -> None:
    message = error_of(model_dir, **{field: 3})
    assert f"{field} set but spec_method is not" in message


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_rollout_draft_lengths_are_refused_for_other_methods(model_dir: Path, method: str) -> None:
    message = error_of(model_dir, spec_method=method, spec_min_share=0.5)
    assert f"spec_min_share apply to spec_method rollout only, not {method}" in message
    message = error_of(model_dir, spec_method=method, spec_background_tokens=0)
    assert f"spec_background_tokens apply to spec_method rollout only, not {method}" in message
    message = error_of(model_dir, spec_method="rollout", spec_min_share=1.5)
    assert "spec_min_share" in message and "less than or equal to 1" in message


def test_ngram_lookup_settings_are_refused_for_suffix(model_dir: Path) -> None:
    message = error_of(model_dir, spec_method="suffix", prompt_lookup_max=4)
    assert "prompt_lookup_max apply to spec_method ngram and rollout only, not suffix" in message


# ---------------------------------------------------------------- vLLM's speculative_config


def test_ngram_config_carries_k_and_the_lookup_window(model_dir: Path) -> None:
    config = build_speculative_config(
        settings(
            model_dir,
            spec_method="ngram",
            num_speculative_tokens=3,
            prompt_lookup_min=2,
            prompt_lookup_max=4,
        )
    )
    assert config == {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 4,
    }


def test_spec_max_batch_becomes_a_batch_size_schedule_that_stops_above_it(
    model_dir: Path,
) -> None:
    config = build_speculative_config(
        settings(
            model_dir,
            spec_method="ngram",
            num_speculative_tokens=5,
            max_num_seqs=64,
            spec_max_batch=8,
        )
    )
    assert config is not None
    # k drafts for 1..8 sequences, none for 9..64 (vLLM carries the last range's count to
    # max_num_seqs, so the zero range must be there).
    assert config["num_speculative_tokens_per_batch_size"] == [(1, 8, 5), (9, 64, 0)]


def test_suffix_without_arctic_inference_fails_with_a_clear_message(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "arctic_inference", None)  # import raises ImportError
    with pytest.raises(ValueError, match="spec_method suffix needs the arctic-inference package"):
        build_speculative_config(settings(model_dir, spec_method="suffix"))


def test_suffix_config_when_arctic_inference_imports(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "arctic_inference", types.ModuleType("arctic_inference"))
    config = build_speculative_config(
        settings(model_dir, spec_method="suffix", num_speculative_tokens=8)
    )
    assert config == {"method": "suffix", "num_speculative_tokens": 8}


# ---------------------------------------------------------------- flags


def test_engine_flags_set_the_speculative_settings(model_dir: Path) -> None:
    parsed = parse_settings(
        [
            f"--model={model_dir}",
            "--spec-method=ngram",
            "--num-speculative-tokens=6",
            "--prompt-lookup-min=3",
            "--prompt-lookup-max=7",
            "--spec-max-batch=4",
        ]
    )
    assert (
        parsed.spec_method,
        parsed.num_speculative_tokens,
        parsed.prompt_lookup_min,
        parsed.prompt_lookup_max,
        parsed.spec_max_batch,
    ) == ("ngram", 6, 3, 7, 4)


def test_engine_flag_refuses_an_unknown_method(model_dir: Path) -> None:
    with pytest.raises(SystemExit):
        parse_settings([f"--model={model_dir}", "--spec-method=medusa"])


def test_rollserve_up_passes_engine_flags_through() -> None:
    args = build_cli_parser().parse_args(
        ["up", "--engine-arg=--spec-method=ngram", "--engine-arg=--spec-max-batch=8"]
    )
    assert args.engine_arg == ["--spec-method=ngram", "--spec-max-batch=8"]


# ---------------------------------------------------------------- Stats


class CountingBackend:
    """A backend that only reports fixed counters."""

    info = ModelInfo(
        model="counting", max_model_len=256, max_num_seqs=8, vocab_size=100, eos_token_id=1
    )

    def counters(self) -> EngineCounters:
        return EngineCounters(spec_drafts=3, spec_draft_tokens=11, spec_accepted_tokens=7)


async def test_stats_reports_the_speculative_counters() -> None:
    servicer = EngineServicer("engine-spec", 0.0)
    servicer.attach(cast(GenerationBackend, CountingBackend()))
    stats = await servicer.Stats(pb.StatsRequest(), cast(Any, None))
    assert (stats.spec_drafts, stats.spec_draft_tokens, stats.spec_accepted_tokens) == (3, 11, 7)


def test_an_ngram_engine_on_cpu_gets_as_many_numba_threads_as_openmp_threads(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rollserve.engine.settings import apply_environment

    # apply_environment writes several variables: on a copy, so none outlives the test
    monkeypatch.setattr(os, "environ", os.environ.copy())
    monkeypatch.delenv("NUMBA_NUM_THREADS", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # as the dev stack starts each engine
    apply_environment(EngineSettings(model=model_dir, spec_method="ngram"), "cpu")
    assert os.environ["NUMBA_NUM_THREADS"] == "1"

    monkeypatch.delenv("NUMBA_NUM_THREADS")
    apply_environment(
        EngineSettings(model=model_dir, spec_method="ngram", omp_num_threads=3), "cpu"
    )
    assert os.environ["NUMBA_NUM_THREADS"] == "3"

    monkeypatch.setenv("NUMBA_NUM_THREADS", "2")  # the operator's own choice stays
    apply_environment(
        EngineSettings(model=model_dir, spec_method="ngram", omp_num_threads=1), "cpu"
    )
    assert os.environ["NUMBA_NUM_THREADS"] == "2"

    monkeypatch.delenv("NUMBA_NUM_THREADS")
    apply_environment(EngineSettings(model=model_dir), "cpu")  # no drafter: left alone
    apply_environment(EngineSettings(model=model_dir, spec_method="ngram"), "cuda")
    assert "NUMBA_NUM_THREADS" not in os.environ


def test_the_rollout_drafter_is_vllms_custom_class_with_its_lookup_in_the_environment(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rollserve.engine.drafter import DRAFTER_CLASS, DRAFTER_ENV, DrafterConfig
    from rollserve.engine.settings import apply_environment

    chosen = settings(
        model_dir,
        spec_method="rollout",
        num_speculative_tokens=3,
        prompt_lookup_min=3,
        prompt_lookup_max=6,
        spec_max_batch=8,
        spec_factor=1.5,
        spec_min_share=0.25,
        spec_background_tokens=4096,
        spec_history_tokens=1000,
        spec_history_per_prompt=3,
    )
    config = build_speculative_config(chosen)
    assert config is not None
    assert (config["method"], config["model"], config["num_speculative_tokens"]) == (
        "custom_class",
        DRAFTER_CLASS,
        3,
    )
    assert "prompt_lookup_min" not in config  # vLLM zeroes them for a custom class
    assert config["num_speculative_tokens_per_batch_size"][0] == (1, 8, 3)
    monkeypatch.setattr(os, "environ", os.environ.copy())
    monkeypatch.delenv(DRAFTER_ENV, raising=False)
    apply_environment(chosen, "cpu")
    assert DrafterConfig.from_env() == DrafterConfig(
        min_n=3,
        max_n=6,
        spec_factor=1.5,
        min_share=0.25,
        background_tokens=4096,
        history_tokens=1000,
        history_per_prompt=3,
    )
    module, name = DRAFTER_CLASS.rsplit(".", 1)
    assert getattr(__import__(module, fromlist=[name]), name).__name__ == name
