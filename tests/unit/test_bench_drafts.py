"""``rollserve bench drafts``: the drafters, the pass-by-pass walk, and the claim the benchmark
rests on (walking plain samples gives what rejection sampling with the same drafts gives).
Nothing is faked: the drafters and the walk are pure; a random Markov chain stands in for a
model where the claim is checked, and vLLM's own ngram search is the reference for ``ngram``."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import numpy as np
import pytest
from rollserve.bench.drafts import (
    PassCounts,
    Rollout,
    SelfMatcher,
    _Index,
    corpus_match,
    measure,
    read_rollouts,
    tail_start,
    walk,
    write_rollouts,
)
from rollserve.engine.drafting import DraftSettings, Match


def test_self_matcher_drafts_what_vllms_ngram_proposer_drafts() -> None:
    ngram = pytest.importorskip("vllm.v1.spec_decode.ngram_proposer")
    reference = ngram._find_longest_matched_ngram_and_propose_tokens
    rng = random.Random(7)
    checked = drafted = 0
    for case in range(300):
        min_n = rng.randint(1, 3)
        settings = DraftSettings(k=rng.randint(1, 6), min_n=min_n, max_n=min_n + rng.randint(0, 4))
        tokens = [rng.randrange(rng.choice((2, 3, 6))) for _ in range(rng.randint(1, 60))]
        matcher = SelfMatcher(settings)
        for end in range(1, len(tokens) + 1):  # grown a token at a time, as a walk grows it
            matcher.extend(tokens[end - 1 : end])
            want = reference(
                np.array(tokens[:end], dtype=np.int32),
                settings.min_n,
                settings.max_n,
                10_000,
                settings.k,
            )
            got = matcher.match().draft
            assert list(got) == want.tolist(), (case, tokens[:end], settings)
            checked += 1
            drafted += bool(got)
    assert drafted > checked // 3  # the cases do draft, often


def test_a_corpus_draft_follows_most_of_its_matches_and_only_what_exists() -> None:
    s = DraftSettings(k=4, min_n=2, max_n=3)
    a = _Index([1, 2, 3, 4, 5, 6], s)
    b = _Index([9, 1, 2, 3, 4, 7, 7], s)
    c = _Index([1, 2, 3, 8], s)
    # Longest suffix first: [1, 2, 3] is in all three; two go on with 4, then a and b part.
    found = corpus_match([0, 1, 2, 3], [(a, 6), (b, 7), (c, 4)], s)
    assert found == Match(3, (4, 5, 6))  # a tie of one vote each: the first met (a) wins
    # Only what exists: with b at 5 tokens and a at 4, a's 5 and b's 7 are not made yet.
    assert corpus_match([0, 1, 2, 3], [(a, 4), (b, 5), (c, 4)], s) == Match(3, (4,))
    # An n-gram whose next token does not exist yet is no match; a shorter one is tried.
    assert corpus_match([5, 2, 3], [(c, 3)], s) == Match(0, ())
    assert corpus_match([5, 2, 3], [(c, 4)], s) == Match(2, (8,))


def test_a_walk_takes_the_matching_drafts_and_one_token_more_each_pass() -> None:
    response = list(range(10))

    def perfect(t: int) -> Match:
        return Match(2, tuple(response[t : t + 3]))

    every, tail = walk(response, perfect, tail_from=8)
    # passes make 4, 4, then the last 2 (the drafts run out with the response)
    assert (every.passes, every.tokens, every.accepted_tokens) == (3, 10, 8)
    assert every.tokens_per_pass == pytest.approx(10 / 3)
    assert (tail.passes, tail.tokens) == (1, 2)

    def wrong_second(t: int) -> Match:
        return Match(2, (response[t], -1, response[t + 2] if t + 2 < 10 else -1))

    every, _ = walk(response, wrong_second, tail_from=99)
    assert every.tokens_per_pass == pytest.approx(2.0)  # one accepted, then the pass's own
    assert every.draft_tokens == 3 * every.drafted_passes

    every, _ = walk(response, lambda t: Match(0, ()), tail_from=0)
    assert (every.passes, every.tokens, every.drafted_passes) == (10, 10, 0)


def _chain(vocab: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.full(vocab, 0.3), size=vocab)  # peaked rows: drafts get accepted
    return np.asarray(p)


def _speculate(
    p: np.ndarray, start: int, length: int, s: DraftSettings, rng: np.random.Generator
) -> PassCounts:
    """Real speculative decoding on the chain: one-hot drafts from the ngram matcher, each
    accepted with the model's probability, a rejection resampled from the rest, a bonus token
    after a fully accepted draft (vLLM's rejection sampler for model-free drafts)."""
    tokens = [start]
    out: list[int] = []
    matcher = SelfMatcher(s)
    matcher.extend(tokens)
    counts = PassCounts()
    while len(out) < length:
        draft = matcher.match().draft
        made: list[int] = []
        accepted = 0
        for d in draft:
            row = p[(tokens + made)[-1]]
            if rng.random() < row[d]:
                made.append(d)
                accepted += 1
                continue
            rest = row.copy()
            rest[d] = 0.0
            made.append(int(rng.choice(len(row), p=rest / rest.sum())))
            break
        else:
            made.append(int(rng.choice(p.shape[0], p=p[(tokens + made)[-1]])))
        made = made[: length - len(out)]
        counts.add(len(draft), min(accepted, len(made)), len(made))
        tokens += made
        out += made
        matcher.extend(made)
    return counts


def test_walking_plain_samples_gives_what_rejection_sampling_gives() -> None:
    s = DraftSettings(k=4, min_n=1, max_n=3)
    p = _chain(vocab=6, seed=3)
    rng = np.random.default_rng(11)
    length, runs = 40, 600
    speculated, walked = PassCounts(), PassCounts()
    for _ in range(runs):
        speculated.merge(_speculate(p, 0, length, s, rng))
        plain = [0]
        for _ in range(length):
            plain.append(int(rng.choice(6, p=p[plain[-1]])))
        matcher = SelfMatcher(s)
        matcher.extend(plain[:1])

        def drafter(t: int, plain: list[int] = plain, matcher: SelfMatcher = matcher) -> Match:
            matcher.extend(plain[len(matcher.tokens) : 1 + t])
            return matcher.match()

        every, _ = walk(plain[1:], drafter, tail_from=length)
        walked.merge(every)
    assert speculated.tokens_per_pass > 1.5  # the chain makes drafting pay, so there is a gap
    # to miss: a walk that forgot the pass's own token would give about 1 less.
    assert walked.tokens_per_pass == pytest.approx(speculated.tokens_per_pass, rel=0.04)


def test_siblings_that_solve_alike_draft_each_other_and_history_helps_a_new_epoch() -> None:
    s = DraftSettings(k=4, min_n=2, max_n=5)
    prompt = (20, 21, 22)
    solution = tuple(range(100, 130))  # no repeats: ngram finds nothing in a sample alone
    other = tuple(range(200, 230))
    rollouts = [
        Rollout("p", 0, prompt, (solution, solution, solution)),
        Rollout("q", 0, (23, 24), (other,)),
        Rollout("p", 1, prompt, (solution,)),
    ]
    names = ["ngram", "group", "history", "all", "rollout"]
    results = {r.name: r for r in measure(rollouts, names, s)}
    assert results["ngram"].every.drafted_passes == 0
    assert results["ngram"].every.tokens_per_pass == 1.0
    # Side by side, a sibling has made as many tokens as the sample: the prompt's n-grams
    # match from the start and each pass finds the continuation the siblings went on to make.
    assert results["group"].every.tokens_per_pass == 1.0  # siblings are never ahead
    history = results["history"].every
    assert history.accepted_tokens == history.draft_tokens > 0  # epoch 1 repeats epoch 0
    assert results["all"].every.tokens_per_pass > 1.0
    # the engine's drafter: nothing from the siblings here, all from the earlier epoch
    assert results["rollout"].every == history


def test_a_fleet_s_engines_keep_only_the_history_they_made() -> None:
    # 40 prompts, each asked again in epoch 1 with the answer of epoch 0: on one engine every
    # second epoch drafts from the first; on 8 engines that each keep their own outputs, only
    # the groups that happen to run where their prompt ran before (about 1 in 8) do.
    s = DraftSettings(k=4, min_n=2, max_n=5)
    rollouts = []
    for epoch in range(2):
        for p in range(40):
            answer = tuple(range(1000 * (p + 1), 1000 * (p + 1) + 30))
            rollouts.append(Rollout(f"p{p}", epoch, (1, 2, p + 3), (answer,)))
    one = measure(rollouts, ["history"], s)[0].every
    assert measure(rollouts, ["history"], s, history_engines=1, seed=5)[0].every == one
    fleet = [
        measure(rollouts, ["history"], s, history_engines=8, seed=seed)[0].every for seed in (0, 1)
    ]
    for every in fleet:
        assert 0 < every.drafted_passes < one.drafted_passes / 3
    assert fleet[0] != fleet[1]  # another seed, other engines
    with pytest.raises(ValueError, match="history_engines"):
        measure(rollouts, ["history"], s, history_engines=0)


def test_the_tail_is_also_counted_epoch_by_epoch() -> None:
    # Epoch k's samples have k earlier groups of their prompt: the simulator's acceptance by
    # history. The second epoch repeats the first, so its tail drafts far better.
    s = DraftSettings(k=4, min_n=2, max_n=5)
    answer = tuple(range(100, 140))
    short = (7, 8, 9, 6, 5)  # a sibling that ends early: the tail is the answer past 5 tokens
    rollouts = [Rollout("p", epoch, (20, 21, 22), (answer, short)) for epoch in range(2)]
    (result,) = measure(rollouts, ["rollout"], s, tail_quantile=0.5)
    assert sorted(result.tail_by_epoch) == [0, 1]
    merged = PassCounts()
    for counts in result.tail_by_epoch.values():
        merged.merge(counts)
    assert merged == result.tail
    assert result.tail_by_epoch[1].tokens_per_pass > 2 * result.tail_by_epoch[0].tokens_per_pass


def test_siblings_that_ended_draft_the_tail() -> None:
    s = DraftSettings(k=4, min_n=2, max_n=5)
    short = tuple(range(1, 9))
    rechecked = (*short, *short)  # solves it, then checks by solving it again
    rollouts = [Rollout("p", 0, (50, 51), (short, rechecked, short))]
    group, rollout = measure(rollouts, ["group", "rollout"], s, tail_quantile=0.5)
    # Side by side the three make the same 8 tokens and none is ahead to draft from: 8
    # passes each. Then the siblings are done; at output 10 the suffix (1, 2) is in them and
    # they went on with 3 4 5 6: all taken, plus the pass's own 7; at 15, (6, 7) -> 8, the end.
    assert (group.every.passes, group.every.tokens) == (8 + 12 + 8, 32)
    assert (group.every.drafted_passes, group.every.accepted_tokens) == (2, 5)
    assert tail_start([8, 16, 8], 0.5) == 8
    # The tail (from output 8): two passes without a draft, then 5 tokens, then 1.
    assert (group.tail.passes, group.tail.tokens) == (4, 8)
    assert group.tail.tokens_per_pass == 2.0
    assert tail_start([8, 16, 8], 0.9) == 16
    # The engine's drafter advances the same: its own first half matches as the siblings do,
    # and at output 15 all three occurrences match seven tokens back and go on with 8; its own
    # first half goes on past 8 (1 2 3), so that draft is 4 tokens long, not 1.
    for mine, theirs in ((rollout.every, group.every), (rollout.tail, group.tail)):
        assert (mine.passes, mine.tokens, mine.accepted_tokens) == (
            theirs.passes,
            theirs.tokens,
            theirs.accepted_tokens,
        )
    assert (rollout.every.draft_tokens, group.every.draft_tokens) == (8, 5)


def test_rollouts_round_trip_and_bad_lines_are_named(tmp_path: Path) -> None:
    rollouts = [
        Rollout("p", 0, (1, 2), ((3, 4), (5,)), spec_proposed=8, spec_accepted=3, spec_drafts=2),
        Rollout("p", 1, (1, 2), ((6,),)),
    ]
    path = tmp_path / "r.jsonl"
    write_rollouts(path, rollouts)
    assert read_rollouts(path) == rollouts
    bad = {
        '{"prompt_key": "p", "epoch": 0, "prompt_token_ids": [1], "responses": [[1, -2]]}': (
            "responses[0] must be a list of token ids"
        ),
        '{"prompt_key": "", "epoch": 0, "prompt_token_ids": [1], "responses": [[1]]}': (
            "prompt_key must be a non-empty string"
        ),
        '{"prompt_key": "p", "epoch": -1, "prompt_token_ids": [1], "responses": [[1]]}': (
            "epoch must be an integer >= 0"
        ),
        '{"prompt_key": "p", "epoch": 0, "prompt_token_ids": [1], "responses": []}': (
            "responses must be a non-empty list"
        ),
        '{"prompt_key": "p", "epoch": 0, "prompt_token_ids": [1], "responses": [[1]], '
        '"spec_drafts": -1}': "spec_drafts must be an integer >= 0",
        "[1, 2]": "a group is a JSON object",
        "{oops": "not JSON",
    }
    for line, message in bad.items():
        path.write_text("\n" + line + "\n")  # a blank first line is skipped
        with pytest.raises(ValueError, match=re.escape(message)) as e:
            read_rollouts(path)
        assert f"{path}:2" in str(e.value)
    path.write_text("\n")
    with pytest.raises(ValueError, match="no groups"):
        read_rollouts(path)


def test_settings_and_drafters_are_checked() -> None:
    with pytest.raises(ValueError, match=r"min_n \(3\) and max_n \(2\)"):
        DraftSettings(min_n=3, max_n=2)
    with pytest.raises(ValueError, match=r"k \(0\) must be at least 1"):
        DraftSettings(k=0)
    with pytest.raises(ValueError, match="unknown drafter 'eagle'"):
        measure([Rollout("p", 0, (1,), ((1,),))], ["eagle"], DraftSettings())


def test_the_command_measures_rollouts_from_a_file(tmp_path: Path) -> None:
    from rollserve.cli.main import main

    solution = tuple(range(100, 130))
    rollouts = [
        Rollout("p", 0, (20, 21), (solution, (*solution[:10], 7, 7))),
        # as the engines reported it when they speculated: 3 of 8 accepted in 2 passes
        Rollout("p", 1, (20, 21), (solution,), spec_proposed=8, spec_accepted=3, spec_drafts=2),
    ]
    samples, report = tmp_path / "r.jsonl", tmp_path / "d.json"
    write_rollouts(samples, rollouts)
    argv = ["bench", "drafts", "--samples", str(samples), "--drafters", "ngram,history"]
    assert main([*argv, "--json", str(report)]) == 0
    data = json.loads(report.read_text())
    assert data["engine_drafts"]["drafted_passes"] == 2
    assert (data["groups"], data["samples"], data["tokens"]) == (2, 3, 72)
    assert set(data["drafters"]) == {"ngram", "history"}
    history = data["drafters"]["history"]["all"]
    assert history["tokens"] == 72
    assert history["accepted_tokens"] > 0  # epoch 1 repeats epoch 0
    assert main([*argv[:-1], "eagle"]) == 2  # an unknown drafter: a clear error, no run
    assert main([*argv, "--speculate"]) == 2  # --speculate makes rollouts; not with a file
