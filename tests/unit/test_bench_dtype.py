"""``rollserve bench dtype``'s settings, round order, merging and summary, on hand-built
measurements (no engine runs: the children's results are built here)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
from rollserve.bench.dtype import (
    DtypeConfig,
    DtypeRun,
    agreement,
    config_from_json,
    merge,
    order_of_rounds,
    summarize,
)
from rollserve.engine.settings import DtypeChoice


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"dtypes": ()}, "dtypes"),
        ({"dtypes": ("float32", "float32")}, "distinct"),
        ({"dtypes": ("float32", "int8")}, "'int8' is not"),
        ({"batches": (0, 8)}, "batches"),
        ({"batches": (1, 512)}, "batches"),
        ({"tokens": 0}, "tokens"),
        ({"repeats": 0}, "repeats"),
        ({"tokens": 2000, "prompt_tokens": 64}, "max_model_len of 2048"),
    ],
)
def test_bad_settings_are_refused_by_name(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DtypeConfig(**overrides)  # type: ignore[arg-type]


def test_the_child_gets_the_parents_settings() -> None:
    cfg = DtypeConfig(model=Path("/m"), dtypes=("bfloat16", "float32"), batches=(2, 4), seed=7)
    assert config_from_json(json.dumps({**asdict(cfg), "model": "/m"})) == cfg


def test_rounds_alternate_the_order_of_the_dtypes() -> None:
    assert order_of_rounds(("float32", "bfloat16"), 3) == [
        "float32",
        "bfloat16",
        "bfloat16",
        "float32",
        "float32",
        "bfloat16",
    ]


def test_a_dtypes_rounds_are_merged_and_its_step_is_the_median_wall_over_tokens() -> None:
    a = DtypeRun("float32", "float32", {1: [0.4, 0.5]}, [0.0])
    b = DtypeRun("float32", "float32", {1: [0.3]}, [1e-5])
    merged = merge([a, b])["float32"]
    assert merged.walls == {1: [0.4, 0.5, 0.3]} and merged.logprob_diffs == [0.0, 1e-5]
    assert merged.step_ms(1, tokens=100) == pytest.approx(4.0)  # 0.4 s over 100 tokens
    with pytest.raises(RuntimeError, match="ran as float32 and as bfloat16"):
        merge([a, DtypeRun("float32", "bfloat16", {1: [0.3]})])


def test_agreement_gives_mean_p99_and_max() -> None:
    diffs = [0.01 * i for i in range(100)]  # 0.00 .. 0.99
    got = agreement(diffs)
    assert got["tokens"] == 100 and got["max"] == pytest.approx(0.99)
    assert got["mean"] == pytest.approx(0.495) and got["p99"] == pytest.approx(0.99)
    assert agreement([]) == {"tokens": 0, "mean": 0.0, "p99": 0.0, "max": 0.0}


def test_the_summary_gives_each_dtypes_step_over_the_firsts() -> None:
    cfg = DtypeConfig(model=Path("m"), batches=(1, 64), tokens=100)
    runs = {
        "float32": DtypeRun("float32", "float32", {1: [0.4], 64: [1.5]}, [0.0]),
        "bfloat16": DtypeRun("bfloat16", "bfloat16", {1: [0.5], 64: [3.45]}, [0.01, 0.03]),
    }
    out = summarize(cfg, runs, DtypeChoice("float32", "the reason"))
    assert out["dtypes"]["float32"]["step_ms"] == {"1": pytest.approx(4.0), "64": 15.0}
    assert out["vs_float32"]["bfloat16"] == {"1": pytest.approx(1.25), "64": pytest.approx(2.3)}
    assert out["vs_float32"]["float32"] == {"1": 1.0, "64": 1.0}
    assert out["dtypes"]["bfloat16"]["logprob_vs_trainer"]["mean"] == pytest.approx(0.02)
    assert (out["auto"], out["auto_why"]) == ("float32", "the reason")
    assert out["settings"]["model"] == "m"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--dtypes", "float32,fp8"], "dtypes: 'fp8' is not float32, bfloat16 or float16"),
        (["--batches", "1,x"], "'1,x' is not comma-separated integers"),
        (["--batches", "0"], "batches ((0,)) must each be 1 to 256"),
    ],
)
def test_the_command_refuses_bad_flags_by_name_and_runs_no_engine(
    flags: list[str], message: str
) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "rollserve.cli.main", "bench", "dtype", *flags],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode != 0 and message in done.stderr
    assert "running" not in done.stdout  # refused before any engine started
