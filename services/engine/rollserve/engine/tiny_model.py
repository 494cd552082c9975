"""A tiny random-weight Llama with a locally trained tokenizer, for tests and local runs.

No weights can be downloaded on the development machines, so integration tests and the dev
stack run vLLM on this model: 2 layers, hidden size 128, random weights drawn from a seeded
generator, and a byte-level BPE tokenizer trained here on a small built-in corpus of English
sentences and arithmetic. Its outputs are meaningless but its shapes, tokenizer files and config
are those of a real Hugging Face Llama checkpoint, so vLLM and transformers load it offline.

The same seed gives the same files. A directory that already holds a complete model (the
marker file is written last) is left as it is.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

__all__ = ["MARKER_FILE", "make_tiny_model"]

MARKER_FILE = ".rollserve-tiny-model"
"""Written last: its presence means the directory holds a complete model."""

_FORMAT_VERSION = 1
_VOCAB_SIZE = 1536
_BOS, _EOS, _PAD = "<s>", "</s>", "<pad>"
_MAX_POSITIONS = 4096
_ARITHMETIC_LINES = 3000

_SENTENCES = (
    "The quick brown fox jumps over the lazy dog.",
    "A reasoning model thinks step by step before it answers.",
    "Let us solve the problem carefully and check the result.",
    "First, we add the two numbers. Then we multiply by three.",
    "The answer is the sum of the digits of the number.",
    "If the train leaves at noon and travels for two hours, it arrives at two.",
    "Reinforcement learning improves the policy with rewards from a verifier.",
    "Each prompt is sampled several times and the group is scored together.",
    "The longest response in a group is often many times the median length.",
    "We write the equation, isolate the unknown, and simplify both sides.",
    "Therefore the final answer is boxed at the end of the solution.",
    "She counted the apples in the basket and found there were twelve.",
    "Prime numbers have exactly two divisors: one and themselves.",
    "The square of a number is the number multiplied by itself.",
    "To check the work, substitute the value back into the equation.",
    "Wait, that is not right. Let me try a different approach.",
)


def _corpus(rng: random.Random) -> list[str]:
    lines = list(_SENTENCES) * 8
    ops = ("+", "-", "*")
    for _ in range(_ARITHMETIC_LINES):
        a, b = rng.randint(0, 999), rng.randint(0, 99)
        op = rng.choice(ops)
        result = a + b if op == "+" else a - b if op == "-" else a * b
        lines.append(f"Question: what is {a} {op} {b}? Answer: {a} {op} {b} = {result}.")
    rng.shuffle(lines)
    return lines


def _write_tokenizer(out_dir: Path, seed: int) -> int:
    """Trains the tokenizer, writes tokenizer.json and tokenizer_config.json; returns its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_VOCAB_SIZE,
        special_tokens=[_BOS, _EOS, _PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(random.Random(seed)), trainer=trainer)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": _BOS,
        "eos_token": _EOS,
        "pad_token": _PAD,
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": _MAX_POSITIONS,
        "clean_up_tokenization_spaces": False,
    }
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config)
    _write_json(
        out_dir / "special_tokens_map.json",
        {"bos_token": _BOS, "eos_token": _EOS, "pad_token": _PAD},
    )
    return int(tokenizer.get_vocab_size())


def _write_json(path: Path, value: object) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def make_tiny_model(out_dir: Path, seed: int = 0) -> Path:
    """Writes the tiny model into ``out_dir`` (created if missing) and returns ``out_dir``.

    Skips all work when ``out_dir`` already holds a complete model made with the same seed.
    """
    out_dir = Path(out_dir)
    marker = out_dir / MARKER_FILE
    fingerprint = f"format={_FORMAT_VERSION} seed={seed}\n"
    if marker.is_file() and marker.read_text(encoding="utf-8") == fingerprint:
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    marker.unlink(missing_ok=True)

    vocab_size = _write_tokenizer(out_dir, seed)
    vocab = json.loads((out_dir / "tokenizer.json").read_text(encoding="utf-8"))["model"]["vocab"]
    bos_id, eos_id, pad_id = vocab[_BOS], vocab[_EOS], vocab[_PAD]

    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=_MAX_POSITIONS,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        tie_word_embeddings=False,
    )
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    finally:
        torch.random.set_rng_state(generator_state)
    model = model.to(torch.bfloat16)
    model.save_pretrained(out_dir, safe_serialization=True)
    GenerationConfig(bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=pad_id).save_pretrained(
        out_dir
    )
    marker.write_text(fingerprint, encoding="utf-8")
    return out_dir
