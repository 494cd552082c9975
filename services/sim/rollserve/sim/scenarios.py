"""Workloads for the simulator: scenarios drawn from distributions, and trace replay.

A scenario file (TOML, shipped ones in ``scenarios/``) sets how many engines and of which
profile, how many groups of how many samples a step asks for, how many steps and epochs, and
how lengths are drawn:

- prompt length: log-normal (``prompt_len_median``, ``prompt_len_sigma``), plus a shared prefix
  (``shared_prefix_len`` tokens, one of ``prefix_pool`` prefixes: a system prompt or few-shot
  block several prompts have in common; 0 for none);
- response length: each prompt has a log-mean ``log(response_median) + prompt_sigma * z_p``; each
  sample adds ``within_sigma * z_s``; between epochs a prompt's log-mean moves by
  ``drift_sigma * z`` (policy updates change lengths); clipped to ``[1, max_tokens]`` where a
  sample that would exceed ``max_tokens`` is cut there (finish reason ``length``);
- ``prompts``: the dataset size; each step draws ``groups_per_step`` of them in order, cycling
  over epochs.

A trace (CSV with the header ``prompt_key,epoch,prompt_len,prefix_id,prefix_len,response_len``,
one row a sample, the rows of a group adjacent; ``prefix_id`` empty when the prompt shares no
prefix with others) replays recorded lengths instead: a scenario file with ``trace = "FILE"``
(relative to the scenario file) takes its groups from it, ``groups_per_step`` at a time in the
trace's order, and has none of the keys that describe drawn lengths. Its ``steps`` defaults to
every complete step the trace holds; a run that needs more steps than that is refused (a trace
is never replayed twice: the predictor would then know every prompt). ``rollserve bench peer
--trace FILE`` records one from real engines.
"""

from __future__ import annotations

import csv
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path

import tomllib

__all__ = [
    "Scenario",
    "SimGroup",
    "load_scenario",
    "read_trace",
    "scenario_names",
    "write_trace",
]

_DIR = Path(__file__).resolve().parent / "scenarios"


@dataclass(frozen=True, slots=True)
class SimGroup:
    """One prompt group of a step, with the true lengths its samples will have."""

    key: str
    prompt_key: str  # the prompt: the samples of a group share all of it
    epoch: int
    prompt_len: int  # tokens, the shared prefix included
    prefix_id: str  # a prefix shared with other prompts ("" for none)
    prefix_len: int  # its tokens (the first prefix_len of the prompt)
    max_tokens: int
    output_lens: tuple[int, ...]

    @property
    def n(self) -> int:
        return len(self.output_lens)


_DRAWN = (
    "prompts",
    "prompt_len_median",
    "prompt_len_sigma",
    "shared_prefix_len",
    "prefix_pool",
    "response_median",
    "prompt_sigma",
    "within_sigma",
    "drift_sigma",
    "seed",
)  # the keys of a scenario whose lengths are drawn; a trace scenario has none of them


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    profile: str
    engines: int
    groups_per_step: int
    n: int
    steps: int
    max_tokens: int
    # Drawn lengths (unused when ``trace`` is set).
    prompts: int = 1
    prompt_len_median: float = 1.0
    prompt_len_sigma: float = 0.0
    shared_prefix_len: int = 0
    prefix_pool: int = 1
    response_median: float = 1.0
    prompt_sigma: float = 0.0
    within_sigma: float = 0.0
    drift_sigma: float = 0.0
    seed: int = 0
    trace: Path | None = None  # replay this trace's recorded lengths instead

    def __post_init__(self) -> None:
        for name in ("engines", "groups_per_step", "n", "steps", "prompts", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"scenario {self.name}: {name} ({getattr(self, name)}) < 1")
        for name in ("prompt_len_sigma", "prompt_sigma", "within_sigma", "drift_sigma"):
            if getattr(self, name) < 0:
                raise ValueError(f"scenario {self.name}: {name} must be >= 0")
        if self.shared_prefix_len > 0 and self.prefix_pool < 1:
            raise ValueError(f"scenario {self.name}: prefix_pool must be >= 1 with a prefix")

    def steps_of_groups(self) -> list[list[SimGroup]]:
        """The groups of every step, drawn with ``seed`` (the same scenario gives the same) or
        the first ``steps`` steps of the trace."""
        if self.trace is not None:
            return self._replayed()
        rng = random.Random(self.seed)
        prompt_lens = [
            max(
                1, round(self.prompt_len_median * math.exp(self.prompt_len_sigma * rng.gauss(0, 1)))
            )
            for _ in range(self.prompts)
        ]
        prefixes = [
            rng.randrange(self.prefix_pool) if self.shared_prefix_len else -1
            for _ in range(self.prompts)
        ]
        log_means = [
            math.log(self.response_median) + self.prompt_sigma * rng.gauss(0, 1)
            for _ in range(self.prompts)
        ]
        out: list[list[SimGroup]] = []
        cursor = 0
        epoch = 0
        for step in range(self.steps):
            groups = []
            for g in range(self.groups_per_step):
                if cursor == self.prompts:
                    cursor = 0
                    epoch += 1
                    log_means = [m + self.drift_sigma * rng.gauss(0, 1) for m in log_means]
                p = cursor
                cursor += 1
                lens = tuple(
                    min(
                        self.max_tokens,
                        max(1, round(math.exp(log_means[p] + self.within_sigma * rng.gauss(0, 1)))),
                    )
                    for _ in range(self.n)
                )
                prefix = prefixes[p]
                groups.append(
                    SimGroup(
                        key=f"s{step}-g{g}",
                        prompt_key=f"p{p}",
                        epoch=epoch,
                        prompt_len=prompt_lens[p] + (self.shared_prefix_len if prefix >= 0 else 0),
                        prefix_id=f"prefix{prefix}" if prefix >= 0 else "",
                        prefix_len=self.shared_prefix_len if prefix >= 0 else 0,
                        max_tokens=self.max_tokens,
                        output_lens=lens,
                    )
                )
            out.append(groups)
        return out

    def _replayed(self) -> list[list[SimGroup]]:
        assert self.trace is not None
        steps = complete_steps(self.trace, self.max_tokens, self.groups_per_step)
        if len(steps) < self.steps:
            raise ValueError(
                f"scenario {self.name}: the trace {self.trace} holds {len(steps)} complete "
                f"step(s) of {self.groups_per_step} groups and the run needs {self.steps} "
                "(over-sampled runs draw more groups than they deliver): give fewer --steps "
                "or --warm-steps, or record a longer trace"
            )
        for groups in steps:
            for g in groups:
                if g.n != self.n:
                    raise ValueError(
                        f"scenario {self.name}: the trace's group of {g.prompt_key} (epoch "
                        f"{g.epoch}) has {g.n} samples; the scenario's n is {self.n}"
                    )
        return steps[: self.steps]


def complete_steps(path: Path, max_tokens: int, groups_per_step: int) -> list[list[SimGroup]]:
    """A trace's steps of ``groups_per_step`` groups; a last step with fewer is left out."""
    steps = read_trace(path, max_tokens, groups_per_step)
    return [groups for groups in steps if len(groups) == groups_per_step]


def scenario_names() -> tuple[str, ...]:
    return tuple(sorted(p.stem for p in _DIR.glob("*.toml")))


def load_scenario(name_or_path: str | Path) -> Scenario:
    """A shipped scenario by name (``S1``…) or a TOML file; unknown or missing keys are errors."""
    path = Path(name_or_path)
    if not path.suffix:
        path = _DIR / f"{name_or_path}.toml"
    if not path.is_file():
        raise ValueError(
            f"scenario {name_or_path!s}: no such file; shipped: {', '.join(scenario_names())}"
        )
    data = tomllib.loads(path.read_text())
    known = {f.name for f in fields(Scenario)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{path}: unknown keys {unknown}; known: {sorted(known)}")
    optional = {"seed", "trace"}
    if "trace" in data:
        drawn = sorted(set(data) & set(_DRAWN))
        if drawn:
            raise ValueError(
                f"{path}: {drawn} describe drawn lengths; a scenario with a trace replays "
                "recorded ones: leave them out"
            )
        trace = data["trace"] = (path.parent / str(data["trace"])).resolve()
        if not trace.is_file():
            raise ValueError(f"{path}: trace {trace}: no such file")
        optional |= {*_DRAWN, "steps"}
        if "steps" not in data and "groups_per_step" in data and "max_tokens" in data:
            data["steps"] = len(
                complete_steps(trace, int(data["max_tokens"]), int(data["groups_per_step"]))
            )
    missing = sorted(f.name for f in fields(Scenario) if f.name not in {*data, *optional})
    if missing:
        raise ValueError(f"{path}: missing keys {missing}")
    return Scenario(**data)


_TRACE_HEADER = ("prompt_key", "epoch", "prompt_len", "prefix_id", "prefix_len", "response_len")


def write_trace(groups: Sequence[SimGroup], path: Path) -> None:
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(_TRACE_HEADER)
        for g in groups:
            for length in g.output_lens:
                writer.writerow(
                    (g.prompt_key, g.epoch, g.prompt_len, g.prefix_id, g.prefix_len, length)
                )


def read_trace(path: Path, max_tokens: int, groups_per_step: int) -> list[list[SimGroup]]:
    """Groups from a trace: adjacent rows with the same (prompt_key, epoch) form one group."""
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        if tuple(reader.fieldnames or ()) != _TRACE_HEADER:
            raise ValueError(f"{path}: header must be {','.join(_TRACE_HEADER)}")
        rows = list(reader)
    groups: list[SimGroup] = []
    current: list[dict[str, str]] = []

    def close() -> None:
        if not current:
            return
        first = current[0]
        groups.append(
            SimGroup(
                key=f"t{len(groups)}",
                prompt_key=first["prompt_key"],
                epoch=int(first["epoch"]),
                prompt_len=int(first["prompt_len"]),
                prefix_id=first["prefix_id"],
                prefix_len=int(first.get("prefix_len") or 0),
                max_tokens=max_tokens,
                output_lens=tuple(min(max_tokens, int(r["response_len"])) for r in current),
            )
        )

    for number, row in enumerate(rows, 2):
        try:
            int(row["epoch"]), int(row["prompt_len"]), int(row["response_len"])
        except ValueError as exc:
            raise ValueError(f"{path}:{number}: {exc}") from exc
        if current and (row["prompt_key"], row["epoch"]) != (
            current[0]["prompt_key"],
            current[0]["epoch"],
        ):
            close()
            current = []
        current.append(row)
    close()
    return [groups[i : i + groups_per_step] for i in range(0, len(groups), groups_per_step)]
