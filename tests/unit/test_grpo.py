"""The GRPO update of the demo's trainer, on the tiny random model (nothing faked: torch and
transformers run; the groups are made up, with the model's own logprobs as the engine's)."""

from __future__ import annotations

from pathlib import Path

import pytest
from rollserve.client import FinishReason, GroupResult, GroupStatus, Sample
from rollserve.engine.tiny_model import make_tiny_model
from rollserve.training.grpo import GrpoConfig, GrpoTrainer, group_advantages


def test_advantages_are_normalised_within_the_group_and_a_flat_group_has_none() -> None:
    assert group_advantages([1.0, 0.0, 1.0, 0.0]) == [1.0, -1.0, 1.0, -1.0]
    assert group_advantages([1.0, 1.0, 1.0]) is None
    assert group_advantages([0.5]) is None


def _group(trainer: GrpoTrainer, group_id: str, responses: list[list[int]]) -> GroupResult:
    """A finished group whose logprobs are the trainer's own (as an engine on its weights)."""
    import torch

    prompt = [5, 6, 7, 8]
    samples = []
    for i, response in enumerate(responses):
        with torch.no_grad():
            logits = trainer.model(input_ids=torch.tensor([prompt + response])).logits[0]
        logp = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
        logprobs = [float(logp[t, token]) for t, token in enumerate(response)]
        samples.append(
            Sample(
                sample_id=f"{group_id}/{i}",
                index=i,
                token_ids=response,
                logprobs=logprobs,
                finish_reason=FinishReason.STOP,
                engine_id="e0",
            )
        )
    return GroupResult(
        run_id="r",
        group_id=group_id,
        status=GroupStatus.DELIVERED,
        prompt_token_ids=prompt,
        samples=samples,
    )


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("grpo-tiny"))


def test_an_update_raises_the_rewarded_response_and_writes_a_checkpoint(
    tiny: Path, tmp_path: Path
) -> None:
    import torch

    trainer = GrpoTrainer(tiny, GrpoConfig(lr=1e-2))
    good, bad = [20, 21, 22], [30, 31, 32]
    results = [_group(trainer, "g", [good, bad]), _group(trainer, "flat", [good, good])]

    def logprob_of(response: list[int]) -> float:
        again = _group(trainer, "probe", [response])
        return sum(again.samples[0].logprobs)

    before_good, before_bad = logprob_of(good), logprob_of(bad)
    update = trainer.step(results, [[1.0, 0.0], [1.0, 1.0]])
    assert update.groups_used == 1 and update.tokens == 6  # the flat group carries no signal
    assert update.max_logprob_gap < 1e-4  # the ratio starts at 1: its own logprobs
    assert logprob_of(good) > before_good and logprob_of(bad) < before_bad
    out = trainer.save(tmp_path / "step-1")
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    assert (out / "config.json").is_file()
    assert torch.isfinite(next(trainer.model.parameters())).all()


def test_a_step_without_any_signal_changes_nothing(tiny: Path) -> None:
    trainer = GrpoTrainer(tiny)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    update = trainer.step([_group(trainer, "flat", [[20], [21]])], [[0.0, 0.0]])
    assert (update.groups_used, update.tokens) == (0, 0)
    assert all((a == p).all() for a, p in zip(before, trainer.model.parameters(), strict=True))
