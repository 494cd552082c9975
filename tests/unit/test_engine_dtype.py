"""The engine's dtype resolution: ``auto`` runs the model in float32 on a CPU that emulates
bfloat16 (a 16-bit checkpoint where its float32 weights fit), and leaves everything else to
vLLM. The CPU is faked by /proc/cpuinfo text, the memory by a number or by /proc and cgroup
files in a temporary folder, and the checkpoint by a config.json and a weight file of the
right size; vLLM is not imported."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from rollserve.engine.cpu_features import cpu_flags, cpu_model, emulates_bf16
from rollserve.engine.host_memory import memory_limit_bytes
from rollserve.engine.settings import (
    UPCAST_MEMORY_SHARE,
    Device,
    EngineSettings,
    checkpoint_dtype,
    checkpoint_weight_bytes,
    choose_dtype,
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


GIB = 1 << 30
MEMORY = 64 * GIB  # the machine's, unless a test says otherwise


def checkpoint(tmp_path: Path, weight_bytes: int = 1000, **config: Any) -> Path:
    """A checkpoint folder: config.json with ``config``, and one weight file of
    ``weight_bytes`` (sparse: nothing is written)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **config}))
    with (tmp_path / "model.safetensors").open("wb") as f:
        f.truncate(weight_bytes)
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
        (AVX2, "bfloat16", "cpu", "float32"),  # upcast: it fits
        (AVX2, "float16", "cpu", "float32"),
        (NATIVE, "bfloat16", "cpu", "auto"),
        (AVX2, "float32", "cuda", "auto"),
        (AVX2, "bfloat16", "cuda", "auto"),
        (AVX2, None, "cpu", "auto"),  # the checkpoint names no dtype: vLLM's to read
    ],
)
def test_auto_runs_float32_where_bfloat16_is_emulated(
    tmp_path: Path, flags: str | None, stored: str | None, device: Device, expected: str
) -> None:
    config: dict[str, Any] = {} if stored is None else {"dtype": stored}
    settings = EngineSettings(model=checkpoint(tmp_path, **config))
    assert resolve_dtype(settings, device, cpuinfo(flags), MEMORY) == expected


@pytest.mark.parametrize("stored", ["bfloat16", "float16"])
def test_a_16_bit_checkpoint_is_upcast_only_where_its_float32_weights_and_kv_cache_fit(
    tmp_path: Path, stored: str
) -> None:
    weights = 3 * GIB
    settings = EngineSettings(
        model=checkpoint(tmp_path, weight_bytes=weights, dtype=stored), kv_cache_space_gib=2
    )
    needed = 2 * weights + 2 * GIB  # 8 GiB: the weights twice their size, and the KV cache
    at_most = int(needed / UPCAST_MEMORY_SHARE)
    assert resolve_dtype(settings, "cpu", cpuinfo(AVX2), at_most) == "float32"
    assert resolve_dtype(settings, "cpu", cpuinfo(AVX2), at_most - 1) == "auto"
    assert resolve_dtype(settings, "cpu", cpuinfo(AVX2), 0) == "auto"  # memory unknown
    # A float32 checkpoint takes no more memory in float32: it stays so whatever the memory.
    float32 = EngineSettings(model=checkpoint(tmp_path / "f", weight_bytes=weights))
    (tmp_path / "f" / "config.json").write_text(json.dumps({"dtype": "float32"}))
    assert resolve_dtype(float32, "cpu", cpuinfo(AVX2), 1) == "float32"


def test_engines_sharing_the_machine_are_upcast_only_where_all_of_them_fit(
    tmp_path: Path,
) -> None:
    """Each of N engines on one machine (the dev stack tells them N) counts N engines'
    float32 weights and KV caches: with the memory one engine's upcast needs, none of two
    is upcast, and with twice that both are. A float32 checkpoint is not counted."""
    weights = GIB
    model = checkpoint(tmp_path, weight_bytes=weights, dtype="bfloat16")
    needed = 2 * weights + 2 * GIB  # one engine's: float32 weights and the default KV cache
    alone = int(needed / UPCAST_MEMORY_SHARE)
    avx2 = cpuinfo(AVX2)
    one, two = (EngineSettings(model=model, engines_per_host=n) for n in (1, 2))
    assert resolve_dtype(one, "cpu", avx2, alone) == "float32"
    assert resolve_dtype(two, "cpu", avx2, alone) == "auto"
    assert resolve_dtype(two, "cpu", avx2, 2 * alone - 1) == "auto"
    assert resolve_dtype(two, "cpu", avx2, 2 * alone) == "float32"
    kept = choose_dtype(two, "cpu", avx2, alone)
    assert kept.slower
    assert "(2 GiB), for each of 2 engines on this machine, would take more than" in kept.why
    assert "for each of" not in choose_dtype(one, "cpu", avx2, alone).why
    float32 = EngineSettings(
        model=checkpoint(tmp_path / "f", dtype="float32"), engines_per_host=1024
    )
    assert resolve_dtype(float32, "cpu", avx2, 1) == "float32"


def test_the_choice_says_why_and_warns_where_vllm_will_emulate_bfloat16(tmp_path: Path) -> None:
    """What the engine logs at start: a warning where the model will run slower than it
    could, with the way out."""
    avx2 = cpuinfo(AVX2)
    bf16 = EngineSettings(model=checkpoint(tmp_path / "b", weight_bytes=GIB, dtype="bfloat16"))
    upcast = choose_dtype(bf16, "cpu", avx2, MEMORY)
    assert (upcast.dtype, upcast.slower) == ("float32", False)
    assert "bfloat16 checkpoint is upcast" in upcast.why
    assert "float32 (2.0 GiB)" in upcast.why and "50% of 64.0 GiB" in upcast.why
    kept = choose_dtype(bf16, "cpu", avx2, 4 * GIB)  # 2 + 2 GiB > half of 4
    assert (kept.dtype, kept.slower) == ("auto", True)
    assert "would take more than 50% of 4.0 GiB" in kept.why and "--dtype float32" in kept.why
    unknown = choose_dtype(bf16, "cpu", avx2, 0)
    assert unknown.slower and "the memory is not known" in unknown.why
    fp32 = EngineSettings(model=checkpoint(tmp_path / "f", dtype="float32"))
    assert choose_dtype(fp32, "cpu", avx2).why.endswith("the float32 checkpoint is not downcast")
    native = choose_dtype(fp32, "cpu", cpuinfo(NATIVE))
    assert (native.dtype, native.slower) == ("auto", False)
    assert choose_dtype(fp32, "cuda", avx2) == choose_dtype(fp32, "cuda", cpuinfo(NATIVE))
    given = EngineSettings(model=fp32.model, dtype="bfloat16")
    assert choose_dtype(given, "cpu", avx2) == choose_dtype(given, "cpu", cpuinfo(NATIVE))
    assert choose_dtype(given, "cpu", avx2).why == "as set"


def test_a_16_bit_checkpoint_without_weight_files_is_left_to_vllm(tmp_path: Path) -> None:
    model = checkpoint(tmp_path, dtype="bfloat16")
    (model / "model.safetensors").unlink()
    assert checkpoint_weight_bytes(model) == 0
    settings = EngineSettings(model=model)
    assert resolve_dtype(settings, "cpu", cpuinfo(AVX2), MEMORY) == "auto"
    assert (
        "the size of its weights is not known"
        in choose_dtype(settings, "cpu", cpuinfo(AVX2), MEMORY).why
    )


def test_weight_bytes_are_those_of_the_safetensors_files_else_the_pytorch_ones(
    tmp_path: Path,
) -> None:
    for name, size in (("a.bin", 7), ("b.safetensors", 100), ("c.safetensors", 23)):
        (tmp_path / name).write_bytes(b"x" * size)
    assert checkpoint_weight_bytes(tmp_path) == 123
    for name in ("b.safetensors", "c.safetensors"):
        (tmp_path / name).unlink()
    assert checkpoint_weight_bytes(tmp_path) == 7
    assert checkpoint_weight_bytes(tmp_path / "missing") == 0


def host(tmp_path: Path, meminfo: str, cgroup: str, files: dict[str, str]) -> int:
    """`memory_limit_bytes` of a machine made of files: /proc/meminfo, /proc/self/cgroup,
    and cgroup files (path under the cgroup root: content)."""
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(meminfo)
    (proc / "self" / "cgroup").write_text(cgroup)
    for path, content in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(content)
    return memory_limit_bytes(proc, root)


MEMINFO = "MemTotal:       24683784 kB\nMemFree:        1000 kB\n"
TOTAL = 24683784 * 1024
UNLIMITED_V1 = "9223372036854771712\n"


@pytest.mark.parametrize(
    ("cgroup", "files", "expected"),
    [
        ("0::/\n", {}, TOTAL),  # no cgroup files: the machine's
        ("0::/job\n", {"job/memory.max": "max\n"}, TOTAL),  # v2, no limit
        ("0::/job\n", {"job/memory.max": "4294967296\n"}, 4 * GIB),  # v2, its own
        ("0::/\n", {"memory.max": "8589934592\n"}, 8 * GIB),  # v2, namespaced: the root's
        (  # v1 (as on this dev machine): its cgroup's file, else the root's
            "4:memory:/box/1\n0::/\n",
            {"memory/box/1/memory.limit_in_bytes": "2147483648\n"},
            2 * GIB,
        ),
        ("4:memory:/box/1\n", {"memory/memory.limit_in_bytes": UNLIMITED_V1}, TOTAL),
        ("3:cpu,memory:/b\n", {"memory/b/memory.limit_in_bytes": "1073741824"}, GIB),
        ("0::/job\n", {"job/memory.max": "999999999999999999999\n"}, TOTAL),  # above it
        (  # a parent's limit binds its children, whose own may be higher or unset
            "0::/slice/job\n",
            {"slice/memory.max": "3221225472\n", "slice/job/memory.max": "max\n"},
            3 * GIB,
        ),
        (
            "0::/slice/job\n",
            {"slice/memory.max": "3221225472\n", "slice/job/memory.max": "1073741824\n"},
            GIB,
        ),
    ],
)
def test_the_memory_a_process_may_use_is_the_machines_or_its_cgroups_limit(
    tmp_path: Path, cgroup: str, files: dict[str, str], expected: int
) -> None:
    assert host(tmp_path, MEMINFO, cgroup, files) == expected


def test_the_memory_is_unknown_without_memtotal(tmp_path: Path) -> None:
    assert host(tmp_path, "MemFree: 10 kB\n", "0::/\n", {"memory.max": "1024"}) == 0
    assert memory_limit_bytes(tmp_path / "none", tmp_path / "none") == 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_a_dtype_given_is_passed_on_as_it_is(tmp_path: Path, dtype: Any) -> None:
    settings = EngineSettings(model=checkpoint(tmp_path, dtype="float32"), dtype=dtype)
    for flags in (AVX2, NATIVE):
        assert resolve_dtype(settings, "cpu", cpuinfo(flags)) == dtype


def test_the_shipped_reasoner_is_a_float32_checkpoint() -> None:
    """It was trained in float32, and engines that do not upcast (CPUs with native
    bfloat16, GPUs) downcast from the trained weights themselves; a checkpoint re-saved in
    16 bits would lose that precision for good, and on AVX2 machines it would run in float32
    only where its upcast weights fit."""
    from rollserve.assets import reasoner_dir

    assert checkpoint_dtype(reasoner_dir()) == "float32"
