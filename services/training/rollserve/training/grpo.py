"""A GRPO policy update on CPU for the demo's trainer loop: learn from a step's groups, write
the new weights as a checkpoint the engines load (``publish_version(..., weights_path=)``).

One update per step, as on-policy GRPO does with one mini-batch: each sample's advantage is
its reward less its group's mean, over the group's standard deviation (groups whose samples
all scored alike carry no signal and are skipped); the loss is PPO's clipped surrogate per
response token, ``-min(r A, clip(r, 1 - eps, 1 + eps) A)`` with ``r`` the ratio of the
token's probability under the weights being trained to the one the engine sampled it with
(the sample's ``logprobs``), averaged over all response tokens of the step. There is no KL
term. The model is trained in float32; the checkpoint keeps the source checkpoint's files
(config, tokenizer) next to the new ``model.safetensors``.
"""

from __future__ import annotations

import shutil
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollserve.client import GroupResult

__all__ = ["GrpoConfig", "GrpoStep", "GrpoTrainer", "group_advantages"]

_WEIGHT_FILES = ("*.safetensors", "*.safetensors.index.json")


@dataclass(frozen=True)
class GrpoConfig:
    lr: float = 2e-5
    clip: float = 0.2  # PPO's epsilon
    grad_clip: float = 1.0
    threads: int = 1  # torch threads: the engines have the other cores


@dataclass(frozen=True)
class GrpoStep:
    """What one update did."""

    loss: float
    groups_used: int  # groups with a reward spread (the others carry no signal)
    tokens: int  # response tokens in the loss
    clipped_share: float  # tokens whose ratio was outside the clip range
    max_logprob_gap: float  # largest |trainer - engine| logprob of a token, before the update


def group_advantages(rewards: Sequence[float]) -> list[float] | None:
    """Each sample's reward less the group's mean, over the group's standard deviation; None
    when every sample scored alike (no signal)."""
    if len(rewards) < 2:
        return None
    spread = statistics.pstdev(rewards)
    if spread == 0:
        return None
    mean = statistics.fmean(rewards)
    return [(r - mean) / spread for r in rewards]


class GrpoTrainer:
    """The policy being trained, from the checkpoint the engines serve at the start."""

    def __init__(self, model_dir: Path, cfg: GrpoConfig | None = None) -> None:
        import torch
        from transformers import LlamaForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # a bar per checkpoint written, in the trainer's log
        self.cfg = cfg or GrpoConfig()
        torch.set_num_threads(self.cfg.threads)
        self._torch = torch
        self._source = model_dir
        self.model: Any = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model.train()
        self._optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.cfg.lr)

    def step(self, results: Sequence[GroupResult], rewards: Sequence[Sequence[float]]) -> GrpoStep:
        """One update from a step's groups and their samples' rewards."""
        torch = self._torch
        cfg = self.cfg
        work = [
            (result, advantages)
            for result, group_rewards in zip(results, rewards, strict=True)
            if (advantages := group_advantages(group_rewards)) is not None
        ]
        tokens = sum(len(s.token_ids) for result, _ in work for s in result.samples)
        if tokens == 0:
            return GrpoStep(0.0, 0, 0, 0.0, 0.0)
        self._optimizer.zero_grad(set_to_none=True)
        total, clipped, gap = 0.0, 0, 0.0
        for result, advantages in work:
            prompt = list(result.prompt_token_ids)
            for sample, advantage in zip(result.samples, advantages, strict=True):
                if not sample.token_ids:
                    continue
                ids = torch.tensor([prompt + list(sample.token_ids)])
                logits = self.model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
                response = torch.tensor(sample.token_ids)
                logp = torch.log_softmax(logits.float(), dim=-1)[
                    torch.arange(len(response)), response
                ]
                old = torch.tensor(sample.logprobs, dtype=torch.float32)
                ratio = torch.exp(logp - old)
                low, high = 1 - cfg.clip, 1 + cfg.clip
                surrogate = torch.minimum(
                    ratio * advantage, torch.clamp(ratio, low, high) * advantage
                )
                loss = -surrogate.sum() / tokens
                loss.backward()
                total += float(loss.detach())
                clipped += int(((ratio < low) | (ratio > high)).sum())
                gap = max(gap, float((logp.detach() - old).abs().max()))
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
        self._optimizer.step()
        return GrpoStep(total, len(work), tokens, clipped / tokens, gap)

    def save(self, out_dir: Path) -> Path:
        """Writes the current weights as a checkpoint folder (the source's other files
        beside them) and returns it."""
        if not all(bool(self._torch.isfinite(p).all()) for p in self.model.parameters()):
            raise RuntimeError("the update made a weight that is not a finite number")
        out_dir.mkdir(parents=True, exist_ok=True)
        for path in self._source.iterdir():
            if path.is_file() and not any(path.match(p) for p in _WEIGHT_FILES):
                shutil.copy2(path, out_dir / path.name)
        self.model.save_pretrained(out_dir, safe_serialization=True)
        return out_dir
