"""The engine's dtype resolution: ``auto`` keeps a float32 checkpoint in float32 on a CPU that
emulates bfloat16, and leaves everything else to vLLM. The CPU is faked by /proc/cpuinfo text
and the checkpoint by a config.json in a temporary folder; vLLM is not imported."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from rollserve.engine.cpu_features import cpu_flags, cpu_model, emulates_bf16
from rollserve.engine.settings import (
    Device,
    EngineSettings,
    checkpoint_dtype,
    resolve_dtype,
)

AVX2 = "fpu sse2 avx avx2 fma"
AVX512 = "fpu sse2 avx avx2 fma avx512f avx512bw avx512vl"
NATIVE = "fpu sse2 avx avx2 fma avx512f avx512_bf16"
AMX = "fpu sse2 avx avx2 fma amx_bf16 amx_tile"


def cpuinfo(flags: str | None, model: str = "AMD EPYC") -> str:
    """/proc/cpuinfo's text for a one-processor machine with these flags (None: no flags
    line, as on another architecture)."""
    return f"processor\t: 0\nmodel name\t: {model}\n" + (
        "" if flags is None else f"flags\t\t: {flags}\n"
    )


def checkpoint(tmp_path: Path, **config: Any) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **config}))
    return tmp_path


@pytest.mark.parametrize(
    ("flags", "emulated"),
    [(AVX2, True), (AVX512, True), (NATIVE, False), (AMX, False), (None, False), ("", False)],
)
def test_a_cpu_emulates_bfloat16_with_avx2_and_neither_avx512_bf16_nor_amx(
    flags: str | None, emulated: bool
) -> None:
    assert emulates_bf16(cpuinfo(flags)) is emulated


def test_cpu_flags_and_model_come_from_the_first_lines_that_name_them() -> None:
    text = cpuinfo(AVX2, "AMD EPYC 9B14") + cpuinfo(NATIVE, "other")
    assert cpu_flags(text) == frozenset(AVX2.split())
    assert cpu_model(text) == "AMD EPYC 9B14"
    assert cpu_model("processor\t: 0\n") == ""
    assert cpu_flags("") == frozenset()


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"dtype": "float32"}, "float32"),
        ({"torch_dtype": "bfloat16"}, "bfloat16"),  # as transformers before 4.56 write it
        ({"dtype": "float16", "torch_dtype": "float32"}, "float16"),
        ({}, None),
        ({"dtype": 32}, None),
    ],
)
def test_the_checkpoint_dtype_is_read_from_its_config(
    tmp_path: Path, config: dict[str, Any], expected: str | None
) -> None:
    assert checkpoint_dtype(checkpoint(tmp_path, **config)) == expected


@pytest.mark.parametrize("text", ["{not json", "[1, 2]"])
def test_an_unreadable_config_names_no_dtype(tmp_path: Path, text: str) -> None:
    (tmp_path / "config.json").write_text(text)
    assert checkpoint_dtype(tmp_path) is None
    assert checkpoint_dtype(tmp_path / "missing") is None


@pytest.mark.parametrize(
    ("flags", "stored", "device", "expected"),
    [
        (AVX2, "float32", "cpu", "float32"),  # vLLM would emulate bfloat16: stays float32
        (AVX512, "float32", "cpu", "float32"),
        (NATIVE, "float32", "cpu", "auto"),  # native bfloat16: vLLM's downcast pays
        (AMX, "float32", "cpu", "auto"),
        (None, "float32", "cpu", "auto"),  # flags unknown: no guess
        (AVX2, "bfloat16", "cpu", "auto"),  # not upcast
        (AVX2, "float32", "cuda", "auto"),
    ],
)
def test_auto_keeps_a_float32_checkpoint_where_bfloat16_is_emulated(
    tmp_path: Path, flags: str | None, stored: str, device: Device, expected: str
) -> None:
    settings = EngineSettings(model=checkpoint(tmp_path, dtype=stored))
    assert resolve_dtype(settings, device, cpuinfo(flags)) == expected


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_a_dtype_given_is_passed_on_as_it_is(tmp_path: Path, dtype: Any) -> None:
    settings = EngineSettings(model=checkpoint(tmp_path, dtype="float32"), dtype=dtype)
    for flags in (AVX2, NATIVE):
        assert resolve_dtype(settings, "cpu", cpuinfo(flags)) == dtype


def test_the_shipped_reasoner_is_a_float32_checkpoint() -> None:
    """The resolution above is what makes it run in float32 on AVX2 machines; a checkpoint
    re-saved in another dtype would silently lose that."""
    from rollserve.assets import reasoner_dir

    assert checkpoint_dtype(reasoner_dir()) == "float32"
