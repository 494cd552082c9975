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
    ``proc``/self/cgroup names under ``cgroup_root`` or of any ancestor of it); 0 where
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
    """The lowest limit of this process's memory cgroup and its ancestors (cgroup v2
    ``memory.max``, v1 ``memory.limit_in_bytes``; a parent's limit binds its children);
    0 where none is set or readable."""
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        lines = []
    files: list[Path] = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and not controllers:  # v2, unified
            base, name = cgroup_root, "memory.max"
        elif "memory" in controllers.split(","):  # v1
            base, name = cgroup_root / "memory", "memory.limit_in_bytes"
        else:
            continue
        parts = Path(path.strip().lstrip("/")).parts
        files += [base.joinpath(*parts[:depth], name) for depth in range(len(parts), -1, -1)]
    # Where /proc/self/cgroup says nothing: a namespaced container's own cgroup is the root.
    files += [cgroup_root / "memory.max", cgroup_root / "memory" / "memory.limit_in_bytes"]
    limits = [limit for f in files if (limit := _limit_of(f))]
    return min(limits) if limits else 0


def _limit_of(path: Path) -> int:
    """A cgroup limit file's bytes; 0 where it is missing, unreadable or "max"."""
    try:
        value = path.read_text().strip()
    except OSError:
        return 0
    return int(value) if value.isdigit() else 0
