"""Validation of submitted groups: proto in, immutable specs out, or a clear error.

Every message names the field and the limit, so the caller can fix the input
without reading our code ("groups[3].n (80) is above the limit (64)").
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from rollserve.client.wire import (
    INT64_MAX,
    MAX_EPOCH,
    MAX_GROUP_ID_LEN,
    MAX_METADATA_BYTES,
    MAX_PROMPT_CHARS_PER_TOKEN,
    MAX_PROMPT_KEY_LEN,
    MAX_RUN_ID_LEN,
    MAX_STOP_LEN,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TEMPERATURE,
    RUN_ID_ALPHABET,
    quoted,
)
from rollserve.scheduler.state import GroupSpec, SamplingSpec
from rollserve.v1 import rollserve_pb2 as pb

MAX_SUBMIT_PROMPT_TOKENS = 8 * 2**20  # the default of the setting of that name


class ValidationError(ValueError):
    """Input that breaks a limit; the message names the field and the limit."""


@dataclass(frozen=True, slots=True)
class Limits:
    max_n: int
    max_groups_per_submit: int
    max_prompt_tokens: int
    max_model_len: int | None  # None until an engine has told us its context
    vocab_size: int | None = None
    max_submit_prompt_tokens: int = MAX_SUBMIT_PROMPT_TOKENS


Tokenize = Callable[[str], list[int]]


def validate_run_id(run_id: str) -> None:
    if not run_id:
        raise ValidationError("run_id is empty; give the run a name")
    if len(run_id) > MAX_RUN_ID_LEN:
        raise ValidationError(f"run_id is {len(run_id)} characters; the limit is {MAX_RUN_ID_LEN}")
    bad = set(run_id) - RUN_ID_ALPHABET
    if bad:
        raise ValidationError(
            f"run_id {run_id!r} has characters {''.join(sorted(bad))!r}; "
            "allowed: letters, digits, '-', '_', '.'"
        )


def validate_submit(
    request: pb.SubmitRequest, limits: Limits, tokenize: Tokenize | None
) -> list[GroupSpec]:
    validate_run_id(request.run_id)
    if not request.groups:
        raise ValidationError("groups is empty; submit at least one group")
    if len(request.groups) > limits.max_groups_per_submit:
        raise ValidationError(
            f"groups has {len(request.groups)} entries; the limit per call is "
            f"{limits.max_groups_per_submit}"
        )
    # Counted before any prompt is read (a text as its least number of tokens) and again
    # once they are: a call's prompts are checked, kept and written at once.
    texts = any(g.prompt_text for g in request.groups)
    least = submit_size(request) // MAX_PROMPT_CHARS_PER_TOKEN
    _check_call_tokens(least, limits, "at least " if texts else "")
    context = _Context(request.run_id, limits, tokenize, time.time())
    seen: set[str] = set()
    specs = []
    for i, group in enumerate(request.groups):
        spec = _validate_group(f"groups[{i}]", group, context)
        if spec.group_id in seen:
            raise ValidationError(
                f"groups[{i}].group_id {spec.group_id!r} appears twice in this request"
            )
        seen.add(spec.group_id)
        specs.append(spec)
    _check_call_tokens(sum(len(spec.prompt_token_ids) for spec in specs), limits)
    return specs


def submit_size(request: pb.SubmitRequest) -> int:
    """How much prompt a Submit carries, reading none of it, in characters: its texts', and
    ``MAX_PROMPT_CHARS_PER_TOKEN`` a token id (the most a token of text may take)."""
    return sum(
        len(g.prompt_token_ids) * MAX_PROMPT_CHARS_PER_TOKEN + len(g.prompt_text)
        for g in request.groups
    )


def _check_call_tokens(tokens: int, limits: Limits, least: str = "") -> None:
    if tokens > limits.max_submit_prompt_tokens:
        raise ValidationError(
            f"groups hold {least}{tokens} prompt tokens; the limit per call is "
            f"{limits.max_submit_prompt_tokens} (max_submit_prompt_tokens): submit fewer at a "
            "time"
        )


@dataclass(frozen=True, slots=True)
class _Context:
    run_id: str
    limits: Limits
    tokenize: Tokenize | None
    now: float


def _validate_group(where: str, group: pb.PromptGroup, context: _Context) -> GroupSpec:
    limits = context.limits
    if not group.group_id:
        raise ValidationError(f"{where}.group_id is empty")
    if len(group.group_id) > MAX_GROUP_ID_LEN:
        raise ValidationError(
            f"{where}.group_id is {len(group.group_id)} characters; the limit is {MAX_GROUP_ID_LEN}"
        )
    where = f"{where} ({_shown(group.group_id)})"
    if len(group.prompt_key) > MAX_PROMPT_KEY_LEN:
        raise ValidationError(
            f"{where}.prompt_key is {len(group.prompt_key)} characters; the limit is "
            f"{MAX_PROMPT_KEY_LEN} (key a longer id by its hash)"
        )
    prompt = _prompt_tokens(where, group, limits, context.tokenize)
    if group.n < 1:
        raise ValidationError(f"{where}.n ({_unset(group.n)}) must be at least 1")
    if group.n > limits.max_n:
        raise ValidationError(f"{where}.n ({group.n}) is above the limit ({limits.max_n})")
    sampling = _validate_sampling(f"{where}.sampling", group.sampling, len(prompt), limits)
    if sampling.seed is not None and sampling.seed + group.n - 1 > INT64_MAX:
        raise ValidationError(
            f"{where}.sampling.seed ({sampling.seed}) + n - 1 ({group.n - 1}) passes int64's "
            f"limit ({INT64_MAX}); sample i is seeded seed + i"
        )
    epoch = group.epoch if group.HasField("epoch") else None
    if epoch is not None and not 0 <= epoch <= MAX_EPOCH:
        raise ValidationError(
            f"{where}.epoch ({epoch}) must be in 0..{MAX_EPOCH} (the pass over the dataset, "
            "from 0); leave it unset to let the scheduler count"
        )
    metadata = tuple(sorted(group.metadata.items()))
    size = sum(len(k.encode()) + len(v.encode()) for k, v in metadata)
    if size > MAX_METADATA_BYTES:
        raise ValidationError(
            f"{where}.metadata holds {size} bytes (UTF-8, keys and values); the limit is "
            f"{MAX_METADATA_BYTES}"
        )
    return GroupSpec(
        run_id=context.run_id,
        group_id=group.group_id,
        prompt_token_ids=prompt,
        n=group.n,
        sampling=sampling,
        prompt_key=group.prompt_key,
        priority=group.priority,
        metadata=metadata,
        submitted_at=context.now,
        epoch=epoch,
        stream_samples=group.stream_samples,
    )


def _shown(group_id: str) -> str:
    """The id as a message shows it: as it is, or quoted when it holds characters that do
    not print (a NUL, a newline that would split the message)."""
    return group_id if group_id.isprintable() else quoted(group_id)


def _prompt_tokens(
    where: str, group: pb.PromptGroup, limits: Limits, tokenize: Tokenize | None
) -> tuple[int, ...]:
    if group.prompt_token_ids and group.prompt_text:
        raise ValidationError(f"{where}: give prompt_token_ids or prompt_text, not both")
    if group.prompt_text:
        if tokenize is None:
            raise ValidationError(
                f"{where}.prompt_text needs a tokenizer: start the scheduler with "
                "--tokenizer MODEL_DIR, or send prompt_token_ids"
            )
        chars = len(group.prompt_text)
        most = limits.max_prompt_tokens * MAX_PROMPT_CHARS_PER_TOKEN
        if chars > most:
            raise ValidationError(
                f"{where}.prompt_text is {chars} characters; the limit is {most} "
                f"({MAX_PROMPT_CHARS_PER_TOKEN} a token of max_prompt_tokens, "
                f"{limits.max_prompt_tokens}): send prompt_token_ids instead"
            )
        tokens = tuple(tokenize(group.prompt_text))
    else:
        tokens = tuple(group.prompt_token_ids)
    if not tokens:
        raise ValidationError(f"{where}: the prompt is empty (prompt_token_ids and prompt_text)")
    if len(tokens) > limits.max_prompt_tokens:
        raise ValidationError(
            f"{where}: the prompt has {len(tokens)} tokens; the limit is {limits.max_prompt_tokens}"
        )
    low, high = min(tokens), max(tokens)
    if low < 0:
        raise ValidationError(f"{where}.prompt_token_ids holds a negative id ({low})")
    if limits.vocab_size is not None and high >= limits.vocab_size:
        raise ValidationError(
            f"{where}.prompt_token_ids holds id {high}; the vocabulary has {limits.vocab_size}"
        )
    return tokens


def _unset(value: int) -> str:
    """A number as a message shows it: 0 is also what a field left out reads as."""
    return "0, or not given" if value == 0 else str(value)


def _validate_sampling(
    where: str, sampling: pb.SamplingParams, prompt_len: int, limits: Limits
) -> SamplingSpec:
    if sampling.max_tokens < 1:
        raise ValidationError(
            f"{where}.max_tokens ({_unset(sampling.max_tokens)}) must be at least 1"
        )
    if limits.max_model_len is not None and prompt_len >= limits.max_model_len:
        where_group = where.removesuffix(".sampling")
        raise ValidationError(
            f"{where_group}: the prompt has {prompt_len} tokens; the model's context is "
            f"{limits.max_model_len}, which leaves none to generate"
        )
    if limits.max_model_len is not None and prompt_len + sampling.max_tokens > limits.max_model_len:
        raise ValidationError(
            f"{where}.max_tokens ({sampling.max_tokens}) exceeds the model's context "
            f"({limits.max_model_len}) minus the prompt ({prompt_len}): at most "
            f"{max(0, limits.max_model_len - prompt_len)}"
        )
    temperature = sampling.temperature if sampling.HasField("temperature") else 1.0
    if not 0 <= temperature <= MAX_TEMPERATURE:
        raise ValidationError(
            f"{where}.temperature ({temperature}) must be in [0, {MAX_TEMPERATURE:g}] "
            "(vLLM's range; 0 is greedy)"
        )
    top_p = sampling.top_p if sampling.HasField("top_p") else 1.0
    if not (math.isfinite(top_p) and 0 < top_p <= 1):
        raise ValidationError(f"{where}.top_p ({top_p}) must be in (0, 1]")
    top_k = sampling.top_k if sampling.HasField("top_k") else -1
    if top_k < -1:
        raise ValidationError(f"{where}.top_k ({top_k}) must be -1 or 0 (off) or >= 1")
    if len(sampling.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise ValidationError(
            f"{where}.stop_token_ids has {len(sampling.stop_token_ids)} ids; the limit is "
            f"{MAX_STOP_TOKEN_IDS}"
        )
    if any(t < 0 for t in sampling.stop_token_ids):
        raise ValidationError(f"{where}.stop_token_ids holds a negative id")
    high = max(sampling.stop_token_ids, default=0)
    if limits.vocab_size is not None and high >= limits.vocab_size:
        raise ValidationError(
            f"{where}.stop_token_ids holds id {high}; the vocabulary has {limits.vocab_size}"
        )
    if len(sampling.stop) > MAX_STOP_STRINGS:
        raise ValidationError(
            f"{where}.stop has {len(sampling.stop)} strings; the limit is {MAX_STOP_STRINGS}"
        )
    if any(not s for s in sampling.stop):
        raise ValidationError(f"{where}.stop holds an empty string")
    longest = max((len(s) for s in sampling.stop), default=0)
    if longest > MAX_STOP_LEN:
        raise ValidationError(
            f"{where}.stop holds a string of {longest} characters; the limit is {MAX_STOP_LEN}"
        )
    return SamplingSpec(
        max_tokens=sampling.max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k if top_k > 0 else -1,
        stop=tuple(sampling.stop),
        stop_token_ids=tuple(sampling.stop_token_ids),
        seed=sampling.seed if sampling.HasField("seed") else None,
    )
