"""``rollserve bench remaining``: the output aligner against a brute-force reading of its
rule, the replay's estimates, and the command. Nothing is faked: the aligner, the length
predictor and the replay are pure; the rollouts are made up here."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path

import pytest
from rollserve.bench.drafts import Rollout, write_rollouts
from rollserve.bench.remaining import (
    AlignerSettings,
    Alignment,
    align,
    estimates,
    measure,
    pick_states,
)
from rollserve.scheduler.core.predictor import LengthPredictor


def _reference(
    outputs: Sequence[Sequence[int]], tokens: Sequence[int], s: AlignerSettings
) -> Alignment | None:
    """The aligner's rule read literally, on lists: every end of the anchor in each of the
    latest outputs, the longest agreement (then the end nearest the progress), the median
    of the votes that reach ``min_match``."""
    if len(tokens) < s.min_match:
        return None
    anchor = list(tokens[-s.anchor :])
    votes = []
    for output in list(outputs)[-s.outputs_per_prompt :]:
        best: tuple[int, int, int] | None = None  # (match, -distance, end)
        for end in range(s.anchor, len(output) + 1):
            if list(output[end - s.anchor : end]) != anchor:
                continue
            match = 0
            while (
                match < min(s.max_match, end, len(tokens))
                and output[end - 1 - match] == tokens[-1 - match]
            ):
                match += 1
            key = (match, -abs(end - len(tokens)), end)
            if best is None or key[:2] > best[:2]:
                best = key
        if best is not None and best[0] >= s.min_match:
            votes.append((len(output) - best[2], best[0]))
    if not votes:
        return None
    lefts = sorted(left for left, _ in votes)
    return Alignment(max(lefts[(len(lefts) - 1) // 2], 1), len(votes), max(m for _, m in votes))


def test_the_aligner_follows_its_rule_on_random_sequences() -> None:
    rng = random.Random(3)
    answered = 0
    for case in range(400):
        anchor = rng.randint(1, 3)
        min_match = anchor + rng.randint(0, 3)
        s = AlignerSettings(
            outputs_per_prompt=rng.randint(1, 4),
            anchor=anchor,
            min_match=min_match,
            max_match=min_match + rng.randint(0, 6),
            max_occurrences=10_000,  # the reference looks at every occurrence
        )
        alphabet = rng.choice((2, 3, 5))
        base = [rng.randrange(alphabet) for _ in range(rng.randint(5, 40))]
        outputs = []
        for _ in range(rng.randint(0, 5)):  # earlier outputs: copies of a base, mutated
            out = [t if rng.random() > 0.1 else rng.randrange(alphabet) for t in base]
            outputs.append([*out[: rng.randint(1, len(out))], rng.randrange(alphabet)])
        tokens = [t if rng.random() > 0.1 else rng.randrange(alphabet) for t in base]
        tokens = tokens[: rng.randint(1, len(tokens))]
        got = align(outputs, tokens, s)
        assert got == _reference(outputs, tokens, s), (case, s, outputs, tokens)
        answered += got is not None
    assert answered > 100  # the cases do align, often


def test_a_sample_that_retraces_an_earlier_output_is_told_exactly_what_is_left() -> None:
    earlier = list(range(100, 160))
    s = AlignerSettings()
    got = align([earlier], earlier[:25], s)
    assert got == Alignment(left=35, outputs=1, match=25)
    # one more output that went another way after token 10 does not agree: one vote
    other = [*earlier[:10], *range(500, 560)]
    assert align([earlier, other], earlier[:25], s) == Alignment(35, 1, 25)
    # three that agree vote: the median of what they have left (the lower middle of two)
    longer, shorter = [*earlier, 7, 7, 7, 7], earlier[:50]
    assert align([earlier, longer, shorter], earlier[:25], s) == Alignment(35, 3, 25)
    assert align([longer, shorter], earlier[:25], s) == Alignment(25, 2, 25)


def test_the_aligner_answers_nothing_it_cannot_stand_behind() -> None:
    s = AlignerSettings(anchor=2, min_match=6)
    earlier = list(range(30))
    assert align([], earlier[:10], s) is None  # no earlier output
    assert align([earlier], earlier[:5], s) is None  # fewer tokens than min_match
    # the anchor is found, but only 3 tokens agree before it
    assert align([earlier], [90, 91, 92, 7, 8, 9], s) is None
    # a token's bytes found across two tokens of the output are no occurrence of it
    straddling = [0x01000000, 0x00000002]  # little-endian: 00 00 00 01 | 02 00 00 00
    one = AlignerSettings(anchor=1, min_match=1)
    assert align([straddling], [0x00000201], one) is None
    assert align([straddling], [0x00000002], one) == Alignment(1, 1, 1)  # at least 1 left


def test_a_loop_aligns_where_the_sample_is() -> None:
    s = AlignerSettings(anchor=2, min_match=2, max_match=2)
    loop = [1, 2] * 20  # "1 2" ends at 2, 4, ..., 40: every end agrees as far as it looks
    assert align([loop], [1, 2] * 8, s) == Alignment(left=24, outputs=1, match=2)
    # "1 2" ends at 2, 4, 6, 8, 11, 13, ...: 15 and 17 are as near to 16, the first counts
    assert align([loop[:9] + loop], [1, 2] * 8, s) == Alignment(left=34, outputs=1, match=2)


def test_only_the_latest_outputs_vote() -> None:
    s = AlignerSettings(outputs_per_prompt=2)
    base = list(range(40))
    outputs = [[*base, 1, 1, 1], base[:30], base[:35]]  # the first is past the latest two
    assert align(outputs, base[:20], s) == Alignment(left=10, outputs=2, match=20)


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError, match=r"min_match \(2\) must be >= anchor \(4\)"):
        AlignerSettings(min_match=2)
    with pytest.raises(ValueError, match=r"max_match \(5\) must be >= min_match \(6\)"):
        AlignerSettings(min_match=6, max_match=5)
    with pytest.raises(ValueError, match=r"outputs_per_prompt \(0\) must be >= 1"):
        AlignerSettings(outputs_per_prompt=0)


def test_the_replay_aligns_with_earlier_epochs_and_finished_siblings_only() -> None:
    s = AlignerSettings()
    long, short = tuple(range(100, 180)), tuple(range(200, 220))
    first = Rollout("p", 0, (1, 2), (long, short))
    again = Rollout("p", 1, (1, 2), (long, short))
    predictor = LengthPredictor()
    # epoch 0: the long sample at 40 tokens has its short sibling finished, nothing like it
    made = estimates(first, 0, 40, predictor=predictor, outputs={}, settings=s)
    assert made["aligned"] == made["progress"] and made["aligned"][1] is False
    # the short one at 10 tokens: its long sibling has not finished, so it is not aligned with
    assert (
        estimates(first, 1, 10, predictor=predictor, outputs={}, settings=s)["aligned"][1] is False
    )
    # epoch 1, with epoch 0's outputs: told exactly
    outputs = {"p": [long, short]}
    assert estimates(again, 0, 40, predictor=predictor, outputs=outputs, settings=s)["aligned"] == (
        40.0,
        True,
    )
    rows = measure([first, again], (0.5,), s)
    aligned, progress = rows[(0.5, "all", "aligned")], rows[(0.5, "all", "progress")]
    assert (aligned.n, aligned.aligned, progress.aligned) == (4, 2, 0)
    assert sorted(aligned.absolute)[:2] == [0.0, 0.0]  # epoch 1's two samples
    assert rows[(0.5, "tail", "aligned")].n == 2  # the long sample of each epoch


def test_the_command_measures_rollouts_from_a_file(tmp_path: Path) -> None:
    from rollserve.cli.main import main

    solution = tuple(range(100, 140))
    rollouts = [
        Rollout("p", epoch, (20, 21), (solution, solution[:20], (*solution[:12], 7, 7)))
        for epoch in range(3)
    ]
    samples, report = tmp_path / "r.jsonl", tmp_path / "rem.json"
    write_rollouts(samples, rollouts)
    argv = ["bench", "remaining", "--samples", str(samples), "--fractions", "0.5,0.75"]
    assert main([*argv, "--json", str(report)]) == 0
    data = json.loads(report.read_text())
    rows = {(r["fraction"], r["samples_of"], r["method"]): r for r in data["rows"]}
    assert set(rows) == {
        (f, which, m)
        for f in (0.5, 0.75)
        for which in ("all", "tail")
        for m in ("progress", "aligned")
    }
    assert rows[(0.75, "all", "aligned")]["samples"] == 9
    assert rows[(0.75, "all", "aligned")]["aligned_share"] > 0
    assert rows[(0.75, "all", "progress")]["aligned_share"] == 0
    with pytest.raises(SystemExit):  # a fraction out of (0, 1): argparse's usage error
        main([*argv[:-1], "1.5"])
    assert main([*argv, "--anchor", "9", "--min-match", "4"]) == 2  # a clear error, no run


def test_the_states_to_continue_are_the_last_epochs_tail_then_others() -> None:
    lengths = [40, 8, 12, 16, 20, 24, 28, 32, 36, 100]
    rollouts = [
        Rollout("p", 0, (1,), (tuple(range(200)),)),  # an earlier epoch: never picked
        *(Rollout(f"q{k}", 1, (1,), (tuple(range(n)),)) for k, n in enumerate(lengths)),
    ]
    states = pick_states(rollouts, (0.25, 0.5), count=3, tail_quantile=0.9, seed=1)
    samples = {(p, i) for p, i, _ in states}
    assert len(samples) == 3 and (10, 0) in samples  # the tail (100 tokens) always
    assert all(p >= 1 for p, _ in samples)
    assert {progress for p, _, progress in states if p == 10} == {25, 50}
    assert pick_states(rollouts, (0.25, 0.5), count=3, tail_quantile=0.9, seed=1) == states
    # a point short of one token is no state
    short = [Rollout("r", 0, (1,), ((5, 6, 7),))]
    assert pick_states(short, (0.25, 0.5), count=1) == [(0, 0, 1)]


def test_resampled_states_are_scored_alone_and_by_their_continuations_median() -> None:
    s = AlignerSettings()
    rollouts = [
        Rollout("p", 0, (1, 2), (tuple(range(100, 180)), tuple(range(200, 220)))),
        Rollout("p", 1, (1, 2), (tuple(range(100, 160)), tuple(range(200, 240)))),
    ]
    # epoch 1's first sample at half its run (30 of 60 tokens): its continuations made 10,
    # 30 and 50 tokens (median 30, what it made); nothing else was continued
    resampled = {(1, 0, 30): [50, 10, 30]}
    rows = measure(rollouts, (0.5,), s, resampled=resampled)
    assert {key[2] for key in rows} == {"progress", "aligned", "resampled"}
    assert all(errors.n == 1 for errors in rows.values())
    assert rows[(0.5, "all", "resampled")].absolute == [0.0]
    # the aligner follows epoch 0's output, which went on 20 tokens longer
    assert rows[(0.5, "all", "aligned")].absolute == [20.0]
