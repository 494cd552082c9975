"""``rollserve model train-reasoner``: a small Llama trained here on the workload's tasks.

The model learns to imitate :class:`rollserve.workload.Reasoner`, a noisy step-by-step solver
(slips that carry on, re-checks that solve again): sampled at temperature 1.0 it answers some
prompts right and some wrong, and writes responses whose length is set mostly by the prompt
and partly by chance, with the long tail of RL rollouts of reasoning models.

Training is supervised next-token prediction on the response tokens (the prompt is context
only), with batches of similar lengths packed to a token budget, AdamW, linear warm-up and a
cosine decay. Everything random is drawn from ``seed``, with a fixed number of CPU threads, so
the same command gives the same weights on the same machine.

The output directory is a Hugging Face checkpoint (``config.json``, ``model.safetensors``,
``tokenizer.json``, ``generation_config.json``) that vLLM and transformers load offline, plus
``training.json`` with the settings and the loss curve.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rollserve.workload import Reasoner
from rollserve.workload.dataset import sample_problem

__all__ = ["ReasonerConfig", "TrainResult", "train_reasoner", "write_tokenizer"]

BOS, EOS, PAD, UNK = "<s>", "</s>", "<pad>", "<unk>"
_WORDS = ("sum", "sort", "count", "in", "pass", "answer", "check", "+", "=", ";", "?")
MARKER_FILE = "training.json"
"""Written last: its presence means the directory holds a complete trained model."""


@dataclass(frozen=True)
class ReasonerConfig:
    """Model shape, data and optimisation settings; the defaults make the shipped model."""

    seed: int = 0
    hidden_size: int = 160
    layers: int = 4
    heads: int = 5
    intermediate_size: int = 448
    max_len: int = 2048  # context: prompt plus response
    steps: int = 720
    batch_tokens: int = 12_288  # padded tokens per optimiser step
    pool: int = 2048  # samples drawn, length-sorted and cut into batches at a time
    lr: float = 3e-3
    min_lr_ratio: float = 0.05
    warmup_steps: int = 60
    weight_decay: float = 0.05
    grad_clip: float = 1.0
    threads: int = 2
    bf16: bool = True  # autocast matmuls to bfloat16 (AVX-512 BF16 / AMX); weights stay fp32
    slip_rate: float = 0.02
    check_rate: float = 0.25

    @property
    def reasoner(self) -> Reasoner:
        return Reasoner(slip_rate=self.slip_rate, check_rate=self.check_rate)


@dataclass
class TrainResult:
    out_dir: Path
    steps: int
    wall_s: float
    final_loss: float
    parameters: int
    losses: list[tuple[int, float]] = field(default_factory=list)


def vocabulary() -> list[str]:
    """Every token the tasks use: specials, digits, letters, task words and signs."""
    from rollserve.workload.tasks import LETTERS

    return [BOS, EOS, PAD, UNK, *(str(d) for d in range(10)), *LETTERS, *_WORDS]


def write_tokenizer(out_dir: Path) -> Any:
    """A word-level tokenizer over :func:`vocabulary` (ids in its order), built with
    ``tokenizers``; returns it.

    Encoding splits on whitespace and prepends ``<s>``; decoding joins tokens with spaces,
    which is the text form the verifier parses.
    """
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, processors

    vocab = {token: i for i, token in enumerate(vocabulary())}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in (BOS, EOS, PAD, UNK)])
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, tokenizer.token_to_id(BOS))]
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": UNK,
        "model_max_length": ReasonerConfig.max_len,
        "clean_up_tokenization_spaces": False,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    special = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": UNK}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    return tokenizer


def _examples(cfg: ReasonerConfig, tokenizer: Any) -> Iterator[tuple[list[int], int]]:
    """Endless (token ids, prompt length) pairs of prompt + noisy reference response + EOS."""
    rng = random.Random(cfg.seed)
    reasoner = cfg.reasoner
    eos = tokenizer.token_to_id(EOS)
    while True:
        problem = sample_problem(rng)
        prompt = tokenizer.encode(problem.prompt()).ids
        response = tokenizer.encode(reasoner.respond(problem, rng), add_special_tokens=False).ids
        ids = [*prompt, *response, eos]
        if len(ids) <= cfg.max_len:
            yield ids, len(prompt)


def _batches(cfg: ReasonerConfig, tokenizer: Any) -> Iterator[list[tuple[list[int], int]]]:
    """Batches of similar lengths, each at most ``batch_tokens`` padded tokens, in seeded order."""
    rng = random.Random(cfg.seed + 1)
    examples = _examples(cfg, tokenizer)
    while True:
        pool = sorted((next(examples) for _ in range(cfg.pool)), key=lambda e: len(e[0]))
        batches: list[list[tuple[list[int], int]]] = []
        current: list[tuple[list[int], int]] = []
        for example in pool:
            # The pool is sorted by length: the newest example is the batch's longest.
            if current and len(example[0]) * (len(current) + 1) > cfg.batch_tokens:
                batches.append(current)
                current = []
            current.append(example)
        if current:
            batches.append(current)
        rng.shuffle(batches)
        yield from batches


def _lr_at(cfg: ReasonerConfig, step: int) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


def _llama_config(cfg: ReasonerConfig, vocab_size: int, tokenizer: Any) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.heads,
        max_position_embeddings=cfg.max_len,
        rope_theta=10_000.0,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.token_to_id(BOS),
        eos_token_id=tokenizer.token_to_id(EOS),
        pad_token_id=tokenizer.token_to_id(PAD),
        torch_dtype="float32",
    )


def train_reasoner(
    out_dir: Path,
    cfg: ReasonerConfig | None = None,
    progress: Callable[[int, float, float], None] | None = None,
) -> TrainResult:
    """Trains the model and writes it to ``out_dir``; ``progress(step, loss, elapsed_s)``."""
    import torch
    from transformers import GenerationConfig, LlamaForCausalLM

    cfg = cfg or ReasonerConfig()
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / MARKER_FILE).unlink(missing_ok=True)
    tokenizer = write_tokenizer(out_dir)
    # Rounded up to a multiple of 8 (ids past the vocabulary are never used).
    vocab_size = -(-tokenizer.get_vocab_size() // 8) * 8
    model = LlamaForCausalLM(_llama_config(cfg, vocab_size, tokenizer))
    model.train()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=cfg.lr,
        betas=(0.9, 0.95),
    )
    pad = tokenizer.token_to_id(PAD)
    batches = _batches(cfg, tokenizer)
    losses: list[tuple[int, float]] = []
    smoothed = float("nan")
    start = time.perf_counter()
    for step in range(cfg.steps):
        batch = next(batches)
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
        labels = torch.full((len(batch), width), -100, dtype=torch.long)
        for row, (ids, prompt_len) in enumerate(batch):
            input_ids[row, : len(ids)] = torch.tensor(ids)
            labels[row, prompt_len : len(ids)] = torch.tensor(ids[prompt_len:])
        for group in optimizer.param_groups:
            group["lr"] = _lr_at(cfg, step)
        # Right padding under a causal mask: real tokens never attend to pads, no mask needed.
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16):
            loss = model(input_ids=input_ids, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        value = float(loss.detach())
        smoothed = value if math.isnan(smoothed) else 0.95 * smoothed + 0.05 * value
        if step % 20 == 0 or step == cfg.steps - 1:
            losses.append((step, round(smoothed, 4)))
            if progress is not None:
                progress(step, smoothed, time.perf_counter() - start)
    wall = time.perf_counter() - start
    model.eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    GenerationConfig(
        bos_token_id=tokenizer.token_to_id(BOS),
        eos_token_id=tokenizer.token_to_id(EOS),
        pad_token_id=pad,
        do_sample=True,
        temperature=1.0,
    ).save_pretrained(out_dir)
    parameters = sum(p.numel() for p in model.parameters())
    result = TrainResult(out_dir, cfg.steps, wall, smoothed, parameters, losses)
    meta = {
        "config": asdict(cfg),
        "parameters": parameters,
        "wall_s": round(wall, 1),
        "final_loss": round(smoothed, 4),
        "losses": losses,
        "torch": torch.__version__,
    }
    (out_dir / MARKER_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return result
