"""Files shipped with rollserve: the trained reasoning model and the default prompt set.

- ``reasoner/``: the model ``rollserve model train-reasoner`` makes with its default settings
  (a Hugging Face Llama checkpoint and tokenizer, loaded offline by vLLM);
- ``prompts/default.jsonl``: ``rollserve workload make --seed 1234 --size 1000``, the prompt set
  ``rollserve workload stats`` and the benchmarks use by default.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["DEFAULT_PROMPTS_SEED", "DEFAULT_PROMPTS_SIZE", "default_prompts", "reasoner_dir"]

_HERE = Path(__file__).resolve().parent
DEFAULT_PROMPTS_SEED = 1234
DEFAULT_PROMPTS_SIZE = 1000


def reasoner_dir() -> Path:
    """The shipped trained model."""
    return _HERE / "reasoner"


def default_prompts() -> Path:
    """The shipped default prompt set (JSON lines of :class:`rollserve.workload.PromptRow`)."""
    return _HERE / "prompts" / "default.jsonl"
