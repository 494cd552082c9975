"""How much memory this process may use: the machine's, or its cgroup's limit where lower.

The engine's dtype resolution reads it before it upcasts a 16-bit checkpoint to float32 on
a CPU that emulates bfloat16 (the weights take twice the memory then). A container's limit
is its cgroup's, not the machine's: /proc/meminfo shows the host's memory inside one.
"""

from __future__ import annotations

import functools
from pathlib import Path

__all__ = ["host_memory_bytes", "memory_limit_bytes"]

PROC = Path("/proc")
CGROUP_ROOT = Path("/sys/fs/cgroup")


def memory_limit_bytes(proc: Path = PROC, cgroup_root: Path = CGROUP_ROOT) -> int:
    """MemTotal of ``proc``/meminfo, or this process's memory cgroup limit where lower
    (cgroup v2 ``memory.max``, v1 ``memory.limit_in_bytes``, of the cgroup that
    ``proc``/self/cgroup names under ``cgroup_root``, else of the root one); 0 where
    MemTotal cannot be read: the caller then assumes nothing."""
    total = _mem_total(proc)
    if not total:
        return 0
    limit = _cgroup_limit(proc, cgroup_root)
    return min(total, limit) if limit else total


@functools.cache
def host_memory_bytes() -> int:
    """`memory_limit_bytes` of this machine, read once a process."""
    return memory_limit_bytes()


def _mem_total(proc: Path) -> int:
    try:
        text = (proc / "meminfo").read_text()
    except OSError:
        return 0
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "MemTotal":
            number, _, unit = value.strip().partition(" ")
            if number.isdigit():
                return int(number) * (1024 if unit.strip().lower() == "kb" else 1)
    return 0


def _cgroup_limit(proc: Path, cgroup_root: Path) -> int:
    """The limit of the first memory cgroup file found (0: none, unreadable or "max")."""
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        lines = []
    candidates: list[Path] = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        relative = path.strip().lstrip("/")
        if hierarchy == "0" and not controllers:  # v2, unified
            candidates.append(cgroup_root / relative / "memory.max")
        elif "memory" in controllers.split(","):  # v1
            candidates.append(cgroup_root / "memory" / relative / "memory.limit_in_bytes")
    candidates += [cgroup_root / "memory.max", cgroup_root / "memory" / "memory.limit_in_bytes"]
    for candidate in candidates:
        try:
            value = candidate.read_text().strip()
        except OSError:
            continue
        return int(value) if value.isdigit() else 0
    return 0
