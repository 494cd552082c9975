"""The reasoner's training code stays alive: a few steps of a very small model, on CPU.

Nothing is faked: real torch, real transformers, real ``tokenizers``; only the model and the
number of steps are small.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from rollserve.assets import reasoner_dir
from rollserve.training.reasoner import MARKER_FILE, ReasonerConfig, train_reasoner
from rollserve.workload import Problem, solve

SMALL = replace(
    ReasonerConfig(),
    hidden_size=32,
    layers=1,
    heads=2,
    intermediate_size=64,
    steps=4,
    warmup_steps=2,
    batch_tokens=1024,
    pool=32,
    threads=1,
)


def test_a_few_steps_write_a_loadable_deterministic_checkpoint(tmp_path: Path) -> None:
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    first = train_reasoner(tmp_path / "a", SMALL)
    second = train_reasoner(tmp_path / "b", SMALL)
    assert first.steps == 4
    assert first.final_loss == pytest.approx(second.final_loss)
    weights = (tmp_path / "a" / "model.safetensors").read_bytes()
    assert weights == (tmp_path / "b" / "model.safetensors").read_bytes()
    meta = json.loads((tmp_path / "a" / MARKER_FILE).read_text())
    assert meta["config"]["steps"] == 4
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "a")
    assert model.config.num_hidden_layers == 1
    tokenizer = Tokenizer.from_file(str(tmp_path / "a" / "tokenizer.json"))
    text = solve(Problem("sum", (34, 17)))
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert tokenizer.token_to_id("<unk>") not in ids
    assert tokenizer.decode(ids) == text
    assert tokenizer.encode("sum 1 + 2 ?").ids[0] == tokenizer.token_to_id("<s>")


def test_shipped_model_is_complete_and_small() -> None:
    path = reasoner_dir()
    for name in ("config.json", "model.safetensors", "tokenizer.json", MARKER_FILE):
        assert (path / name).is_file(), name
    size = sum(p.stat().st_size for p in path.iterdir() if p.is_file())
    assert size <= 20 * 1024 * 1024
    meta = json.loads((path / MARKER_FILE).read_text())
    # The shipped model is what the default settings make.
    defaults = ReasonerConfig().__dict__
    assert meta["config"] == json.loads(json.dumps(defaults))
