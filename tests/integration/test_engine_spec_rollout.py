"""Speculative decoding with rollserve's ``rollout`` drafter (``rollserve.engine.drafter``) on
a real vLLM engine on CPU, with the tiny random model: drafts from the sample's own tokens, its
siblings, and earlier samples of the same prompt.

The session's shared engine does not speculate and is the reference for greedy output, as in
``test_engine_spec.py``. The drafter is loaded by vLLM itself (``custom_class``), in the
engine core process, with its hooks into vLLM's model runner; a prompt's earlier outputs are
indexed in the engine's step when they are shorter than ``BACKGROUND_TOKENS`` (so what the
drafts take from them does not depend on how soon a thread runs), and on the drafter's
thread when longer.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest
from rollserve.v1 import rollserve_pb2 as pb
from rollserve.v1 import rollserve_pb2_grpc as pb_grpc

from tests.integration.engine_proc import serving_engine
from tests.integration.test_engine_spec import (
    PROMPTS,
    SPEC_TOKENS,
    assert_same_greedy,
    greedy,
    logprob_tolerance,
)
from tests.unit.fuzz import Campaign
from tests.unit.test_fuzz_api import check_engine

pytestmark = pytest.mark.integration

# Earlier outputs of a prompt of at least this many tokens are indexed on the drafter's
# thread: more than two of MAX_TOKENS (test_engine_spec's 200).
BACKGROUND_TOKENS = 500


@pytest.fixture(scope="module")
def rollout_engine(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """host:port of an engine that speculates with the rollout drafter in every step."""
    with serving_engine(
        tiny_model_dir,
        "engine-rollout",
        [
            "--spec-method=rollout",
            f"--num-speculative-tokens={SPEC_TOKENS}",
            f"--spec-background-tokens={BACKGROUND_TOKENS}",
        ],
        log_dir=tmp_path_factory.mktemp("engine-rollout-logs"),
    ) as address:
        yield address


@pytest.fixture
async def rollout_stub(rollout_engine: str) -> AsyncIterator[pb_grpc.EngineAsyncStub]:
    async with grpc.aio.insecure_channel(rollout_engine) as channel:
        yield pb_grpc.EngineStub(channel)


async def test_rollout_drafts_keep_greedy_output(
    rollout_stub: pb_grpc.EngineAsyncStub, plain_stub: pb_grpc.EngineAsyncStub
) -> None:
    before = await rollout_stub.Stats(pb.StatsRequest())
    tolerance = await logprob_tolerance(rollout_stub, plain_stub)
    for i, prompt in enumerate(PROMPTS):
        spec = await greedy(rollout_stub, f"keep-{i}", prompt, n=2)
        plain = (await greedy(plain_stub, f"keep-plain-{i}", prompt))[0]
        for sample in spec.values():
            assert_same_greedy(sample, plain, tolerance, f"prompt {i}")
            assert sample.spec_accepted_tokens <= sample.spec_draft_tokens
    after = await rollout_stub.Stats(pb.StatsRequest())
    assert after.spec_drafts > before.spec_drafts
    assert after.spec_accepted_tokens - before.spec_accepted_tokens > 0


async def test_a_prompt_asked_again_drafts_from_its_earlier_samples(
    rollout_stub: pb_grpc.EngineAsyncStub,
) -> None:
    """Greedy decoding of a prompt asked before makes the tokens it made then, and the
    drafter has them whole: nearly every draft token is accepted, and each pass advances by
    about the draft length. The first time, only the sample's own repeats can be drafted."""
    prompt = [7 + 3 * j for j in range(40)]  # a prompt no other test sends
    first = (await greedy(rollout_stub, "again-0", prompt))[0]
    second = (await greedy(rollout_stub, "again-1", prompt))[0]
    # first: only its own repeats to draft from
    assert_drafted_from(first, second, first, await logprob_tolerance(rollout_stub))


async def test_outputs_a_call_carries_are_drafted_from_as_if_the_engine_had_made_them(
    rollout_stub: pb_grpc.EngineAsyncStub, plain_stub: pb_grpc.EngineAsyncStub
) -> None:
    """A prompt this engine never ran, with its greedy output made on another engine in the
    call's ``earlier_outputs`` (as the scheduler sends what other engines made): the drafter
    has it whole from the first sample on, and the output is the same as without."""
    assert (await rollout_stub.Stats(pb.StatsRequest())).takes_earlier_outputs
    assert not (await plain_stub.Stats(pb.StatsRequest())).takes_earlier_outputs
    prompt = [11 + 5 * j for j in range(40)]  # prompts no other test sends
    control = [13 + 5 * j for j in range(40)]
    made = (await greedy(plain_stub, "carried-plain", prompt))[0]
    told = (await greedy(rollout_stub, "carried-0", prompt, earlier_outputs=[made.token_ids]))[0]
    fresh = (await greedy(rollout_stub, "carried-control", control))[0]
    assert_drafted_from(made, told, fresh, await logprob_tolerance(rollout_stub, plain_stub))


async def test_a_long_history_indexed_on_the_drafter_s_thread_is_drafted_from(
    rollout_stub: pb_grpc.EngineAsyncStub, plain_stub: pb_grpc.EngineAsyncStub
) -> None:
    """Earlier outputs of ``BACKGROUND_TOKENS`` or more are indexed on the drafter's thread
    in vLLM's engine core, and the sample drafts from them once that is done: it makes the
    same tokens and takes more from drafts than a prompt with nothing. (How many more
    depends on how soon the thread ran, so no share of the tokens is asserted; indexing a
    few hundred tokens takes well under a millisecond, the call hundreds of steps.)"""
    prompt = [29 + 5 * j for j in range(40)]  # prompts no other test sends
    control = [31 + 5 * j for j in range(40)]
    made = (await greedy(plain_stub, "thread-plain", prompt))[0]
    copies = BACKGROUND_TOKENS // len(made.token_ids) + 1
    assert copies * len(made.token_ids) >= BACKGROUND_TOKENS
    told = (
        await greedy(rollout_stub, "thread-0", prompt, earlier_outputs=[made.token_ids] * copies)
    )[0]
    fresh = (await greedy(rollout_stub, "thread-control", control))[0]
    assert_same_greedy(told, made, await logprob_tolerance(rollout_stub, plain_stub))
    assert told.spec_accepted_tokens > fresh.spec_accepted_tokens, (
        told.spec_accepted_tokens,
        fresh.spec_accepted_tokens,
    )


async def test_outputs_added_outside_a_call_are_drafted_from_by_the_prompt_s_next_samples(
    rollout_stub: pb_grpc.EngineAsyncStub, plain_stub: pb_grpc.EngineAsyncStub
) -> None:
    """AddOutputs (the scheduler's push of outputs finished on other engines) reaches the
    drafter in vLLM's engine core as a call's ``earlier_outputs`` do: the prompt's next
    sample drafts from them. An engine that does not draft from them takes none."""
    prompt = [17 + 5 * j for j in range(40)]  # prompts no other test sends
    control = [19 + 5 * j for j in range(40)]
    made = (await greedy(plain_stub, "pushed-plain", prompt))[0]
    outputs = [pb.EarlierOutput(token_ids=made.token_ids)]
    request = pb.AddOutputsRequest(
        prompts=[pb.PromptOutputs(prompt_token_ids=prompt, outputs=outputs)]
    )
    assert (await rollout_stub.AddOutputs(request, timeout=60)).taken == 1
    assert (await plain_stub.AddOutputs(request, timeout=60)).taken == 0
    told = (await greedy(rollout_stub, "pushed-0", prompt))[0]
    fresh = (await greedy(rollout_stub, "pushed-control", control))[0]
    assert_drafted_from(made, told, fresh, await logprob_tolerance(rollout_stub, plain_stub))


def assert_drafted_from(
    made: pb.Complete, told: pb.Complete, fresh: pb.Complete, tolerance: float
) -> None:
    """``told``, greedy on a prompt whose output ``made`` the drafter was given, made the same
    tokens (up to a near-tie, after which the drafts of ``made`` no longer fit), drafted
    nearly all of them from it, and more than ``fresh`` (a prompt it had nothing of) took
    from drafts (logprobs compared within ``tolerance``, `logprob_tolerance`)."""
    shared = assert_same_greedy(told, made, tolerance)
    assert told.spec_draft_tokens > 0
    if shared == len(made.token_ids):  # (else the drafts after the tie were turned down)
        assert told.spec_accepted_tokens >= 0.9 * told.spec_draft_tokens, (
            told.spec_accepted_tokens,
            told.spec_draft_tokens,
        )
    # all but the tokens the passes sampled themselves came from drafts
    assert told.spec_accepted_tokens >= 0.7 * shared, (told.spec_accepted_tokens, shared)
    assert told.spec_accepted_tokens > fresh.spec_accepted_tokens, (
        told.spec_accepted_tokens,
        fresh.spec_accepted_tokens,
    )


async def test_top_k_without_top_p_samples_on_a_speculating_engine(
    rollout_stub: pb_grpc.EngineAsyncStub,
) -> None:
    """A speculating engine verifies at every step, also one without drafts (a new request's
    first): on CPUs, top-k sampling without top-p took vLLM's engine core down there
    (``rollserve.engine.vllm_fixes`` guards it). The call ends with every sample."""
    request = pb.GenerateRequest(
        request_id="top-k-only",
        prompt_token_ids=[29 + 5 * j for j in range(40)],
        n=2,
        sampling=pb.SamplingParams(temperature=1.0, top_k=3, top_p=1.0, max_tokens=16, seed=5),
    )
    ends = 0
    async for reply in rollout_stub.Generate(request, timeout=120):
        assert reply.WhichOneof("kind") != "error", reply.error.message
        ends += reply.WhichOneof("kind") == "complete"
    assert ends == 2
    await rollout_stub.Stats(pb.StatsRequest(), timeout=30)


# A campaign of 50 requests an RPC (ROLLSERVE_FUZZ_MUTANTS and ROLLSERVE_FUZZ_SEED make a
# longer one, as in test_fuzz_api)
FUZZ = Campaign.from_env(count=50, seed=11)
FUZZ_MAX_TOKENS = 32  # a Generate call's samples are cut to this many tokens (CPU time)


async def test_no_request_crashes_the_engine_or_its_drafter(
    rollout_stub: pb_grpc.EngineAsyncStub,
) -> None:
    """``tests/unit/test_fuzz_api.py``'s requests, changed at their fields' edges, against
    vLLM and the drafter in its engine core (Generate with earlier outputs, AddOutputs,
    Abort, Stats; UpdateWeights is left out: a valid one would change the shared engine's
    weights version): each answer is OK or a refusal naming a field, each Generate call ends
    (its samples cut to ``FUZZ_MAX_TOKENS``), the engine serves after each, and a greedy
    sample made before is made again after. (Reading a call for a while and cancelling it hid
    calls that never ended: a temperature above 2, which vLLM refuses when it builds the
    sampling parameters, ended the sample's task and left the call waiting.)"""
    prompt = [23 + 5 * j for j in range(40)]  # a prompt no other test sends
    before = (await greedy(rollout_stub, "fuzz-before", prompt))[0]

    async def alive() -> None:
        await rollout_stub.Stats(pb.StatsRequest(), timeout=30)

    await check_engine(
        rollout_stub,
        alive,
        refusing=("Generate", "AddOutputs"),
        campaign=FUZZ,
        max_tokens=FUZZ_MAX_TOKENS,
        update_weights=False,
        timeout_s=120,
    )
    after = (await greedy(rollout_stub, "fuzz-after", prompt))[0]
    # (drafted from it: other verification passes)
    assert_same_greedy(after, before, await logprob_tolerance(rollout_stub))
