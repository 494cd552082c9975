"""What a simulated sample says: how long it is, its token ids and their logprobs.

Nothing here is random at run time: a sample is a function of its prompt's token ids, its
**draw** and the sim's ``seed``, so the same request gives the same samples on any engine, in
any process, in any order, and a test can compute what an engine will answer.

**The draw** of sample ``i`` of a request: with a sampling seed, ``seed + i`` (the per-sample
seed vLLM is given, so the same prompt with the same seed gives the same sample, as in vLLM);
without one, the index ``i``; with temperature 0 (greedy), one draw for every sample of the
prompt (greedy samples are identical).

**Length** (:class:`LengthModel`), the shape of scenario S1 by default: a response of prompt
``p`` and draw ``d`` is long ``round(median * exp(prompt_sigma * z_p + within_sigma * z_pd))``
tokens, at least 1, where ``z_p`` is a standard normal fixed by (seed, prompt) (the prompt's
own length: prompt identity explains most of the variance, and a long prompt stays long) and
``z_pd`` one fixed by (seed, prompt, draw) (the spread within a group). A **lengths file**
replaces the model for the prompts it lists: CSV with the header ``prompt_hash,response_len``,
one row a sample, the rows of a prompt in index order (see :func:`prompt_hash`); a listed
prompt's draw ``d`` (the index, or seed + index) takes its row ``d`` modulo its rows, a greedy
one its first row. A sample whose length fits in
its cap (``max_tokens``, and the context left after the prompt) ends with the EOS token, finish
reason ``stop``; a longer one is cut at the cap, ``length``.

**Tokens** (:class:`TokenStream`): the id at position ``j`` of a sample is a counter-based hash
(splitmix64) of (sample key, ``j``), uniform over the vocabulary without the EOS token and the
request's stop token ids; the last token of a ``stop`` sample is EOS. Any slice of a sample can
be made on its own, so chunks are cut wherever the engine flushes. **Logprobs** are
``0.5 * log(u)`` with ``u`` uniform in (0, 1]: all at most 0, mean -0.5, a few far below.

Left out: stop strings (nothing is detokenized), any dependence of length on the sampling
parameters other than the seed, and token ids that mean anything.
"""

from __future__ import annotations

import csv
import hashlib
import math
import struct
import sys
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from statistics import NormalDist

import numpy as np
import numpy.typing as npt

__all__ = [
    "LengthModel",
    "TokenStream",
    "load_lengths",
    "prompt_digest",
    "prompt_hash",
    "sample_draw",
]

LOGPROB_SCALE = 0.5
"""Logprobs are ``LOGPROB_SCALE * log(u)``, u uniform in (0, 1]: mean -LOGPROB_SCALE."""

_GREEDY_DRAW = b"g"
_STANDARD_NORMAL = NormalDist()
_U64 = 2**64
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX_1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX_2 = np.uint64(0x94D049BB133111EB)
_LENGTHS_HEADER = ("prompt_hash", "response_len")


def prompt_digest(token_ids: Sequence[int]) -> bytes:
    """16 bytes that identify a prompt: BLAKE2b of its ids as little-endian int32."""
    ids = array("i", token_ids)
    if sys.byteorder == "big":
        ids.byteswap()
    return hashlib.blake2b(ids.tobytes(), digest_size=16).digest()


def prompt_hash(token_ids: Sequence[int]) -> str:
    """The prompt's key in a lengths file: :func:`prompt_digest` in hex (32 characters)."""
    return prompt_digest(token_ids).hex()


def sample_draw(index: int, seed: int | None, greedy: bool) -> bytes:
    """The draw that decides sample ``index`` of a request (see the module docstring)."""
    if greedy:
        return _GREEDY_DRAW
    if seed is not None:
        return b"s" + struct.pack("<q", seed + index)
    return b"i" + struct.pack("<q", index)


def _hash64(*parts: bytes) -> int:
    h = hashlib.blake2b(digest_size=8)
    for part in parts:
        h.update(struct.pack("<I", len(part)))
        h.update(part)
    return int.from_bytes(h.digest(), "little")


def _normal(*parts: bytes) -> float:
    """A standard normal fixed by ``parts``."""
    return _STANDARD_NORMAL.inv_cdf((_hash64(*parts) + 0.5) / _U64)


def load_lengths(path: Path) -> dict[str, tuple[int, ...]]:
    """A lengths file (see the module docstring): prompt hash -> response lengths by index."""
    table: dict[str, list[int]] = {}
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        if tuple(reader.fieldnames or ()) != _LENGTHS_HEADER:
            raise ValueError(f"{path}: header must be {','.join(_LENGTHS_HEADER)}")
        for line, row in enumerate(reader, 2):
            key = row["prompt_hash"].strip().lower()
            if len(key) != 32 or any(c not in "0123456789abcdef" for c in key):
                raise ValueError(
                    f"{path}:{line}: prompt_hash {key!r} is not 32 hex digits "
                    "(rollserve.sim.responses.prompt_hash of the prompt's token ids)"
                )
            try:
                length = int(row["response_len"])
            except ValueError:
                raise ValueError(
                    f"{path}:{line}: response_len {row['response_len']!r} is not an integer"
                ) from None
            if length < 1:
                raise ValueError(f"{path}:{line}: response_len ({length}) must be at least 1")
            table.setdefault(key, []).append(length)
    return {key: tuple(lengths) for key, lengths in table.items()}


@dataclass(frozen=True)
class LengthModel:
    """Response lengths: log-normal by prompt and draw, or a lengths file's rows."""

    median: float = 1000.0
    prompt_sigma: float = 0.95
    within_sigma: float = 0.6
    seed: int = 0
    table: Mapping[str, tuple[int, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.median) and self.median >= 1):
            raise ValueError(f"median ({self.median}) must be at least 1")
        for name in ("prompt_sigma", "within_sigma"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} ({value}) must be at least 0")

    def natural_length(self, digest: bytes, draw: bytes) -> int:
        """Tokens the sample would have with no cap (its EOS included)."""
        listed = self.table.get(digest.hex()) if self.table else None
        if listed:
            if draw == _GREEDY_DRAW:
                return listed[0]
            position: int = struct.unpack("<q", draw[1:])[0]
            return listed[position % len(listed)]
        seed = struct.pack("<q", self.seed)
        log_length = math.log(self.median)
        if self.prompt_sigma:
            log_length += self.prompt_sigma * _normal(b"prompt", seed, digest)
        if self.within_sigma:
            log_length += self.within_sigma * _normal(b"within", seed, digest, draw)
        # The exponent is bounded (a normal from 64 bits is within about 9.5 sigma).
        return max(1, round(math.exp(log_length)))

    def token_key(self, digest: bytes, draw: bytes) -> int:
        """The 64-bit key of the sample's token stream."""
        return _hash64(b"tokens", struct.pack("<q", self.seed), digest, draw)


def _splitmix(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """splitmix64's finaliser on an array of uint64 (wrapping arithmetic)."""
    x = (x ^ (x >> np.uint64(30))) * _MIX_1
    x = (x ^ (x >> np.uint64(27))) * _MIX_2
    return x ^ (x >> np.uint64(31))


class TokenStream:
    """Token ids and logprobs of samples, position by position (see the module docstring)."""

    def __init__(self, vocab_size: int, eos_token_id: int) -> None:
        if vocab_size < 2:
            raise ValueError(f"vocab_size ({vocab_size}) must be at least 2")
        if not 0 <= eos_token_id < vocab_size:
            raise ValueError(
                f"eos_token_id ({eos_token_id}) must be in [0, vocab_size {vocab_size})"
            )
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id

    def tokens(
        self,
        key: int,
        start: int,
        end: int,
        eos_at: int | None,
        banned: Sequence[int] = (),
    ) -> tuple[list[int], list[float]]:
        """Ids and logprobs of positions ``start`` to ``end - 1``; EOS at ``eos_at``; no id
        of ``banned`` (the request's stop token ids) is ever drawn."""
        if end <= start:
            return [], []
        positions = np.arange(start, end, dtype=np.uint64)
        x = _splitmix(positions * _GOLDEN + np.uint64(key))
        eos = self.eos_token_id
        ids = x % np.uint64(self.vocab_size - 1)  # the vocabulary without EOS ...
        ids += ids >= np.uint64(eos)  # ... mapped past it
        if banned:
            stops = np.array([t for t in banned if t != eos], dtype=np.uint64)
            hit = np.isin(ids, stops)
            if hit.any():
                allowed = self._first_allowed(set(banned))
                if allowed is not None:
                    ids[hit] = np.uint64(allowed)
        u = ((_splitmix(x) >> np.uint64(11)) + np.uint64(1)).astype(np.float64) * 2.0**-53
        logprobs = LOGPROB_SCALE * np.log(u)
        id_list: list[int] = ids.tolist()
        if eos_at is not None and start <= eos_at < end:
            id_list[eos_at - start] = eos
        logprob_list: list[float] = logprobs.tolist()
        return id_list, logprob_list

    def _first_allowed(self, banned: set[int]) -> int | None:
        return next(
            (t for t in range(self.vocab_size) if t != self.eos_token_id and t not in banned),
            None,
        )
