import pytest
from rollserve.client.wire import MAX_EPOCH
from rollserve.scheduler.validation import Limits, ValidationError, validate_submit
from rollserve.v1 import rollserve_pb2 as pb

from tests.unit.builders import proto_group

LIMITS = Limits(max_n=8, max_groups_per_submit=4, max_prompt_tokens=100, max_model_len=64)


def submit(*groups: pb.PromptGroup, run_id: str = "run-1") -> pb.SubmitRequest:
    return pb.SubmitRequest(run_id=run_id, groups=list(groups))


def test_valid_group_becomes_a_spec_with_defaults() -> None:
    [spec] = validate_submit(submit(proto_group("a", n=3, max_tokens=20)), LIMITS, None)
    assert spec.group_id == "a" and spec.n == 3 and spec.run_id == "run-1"
    assert spec.sampling.temperature == 1.0 and spec.sampling.top_p == 1.0
    assert spec.sampling.max_tokens == 20 and spec.sampling.seed is None


@pytest.mark.parametrize(
    ("group", "message"),
    [
        (
            pb.PromptGroup(group_id="a", n=1, sampling=pb.SamplingParams(max_tokens=4)),
            "prompt is empty",
        ),
        (proto_group("a", n=0), r"n \(0, or not given\) must be at least 1"),
        (proto_group("a", n=9), r"n \(9\) is above the limit \(8\)"),
        (proto_group("a", max_tokens=0), r"max_tokens \(0, or not given\) must be at least 1"),
        (
            proto_group("a", max_tokens=60),
            r"max_tokens \(60\) exceeds the model's context \(64\) minus the prompt \(5\)",
        ),
        (
            pb.PromptGroup(
                group_id="a",
                prompt_token_ids=[1] * 64,
                n=1,
                sampling=pb.SamplingParams(max_tokens=1),
            ),
            r"groups\[0\] \(a\): the prompt has 64 tokens; the model's context is 64, which "
            "leaves none to generate",
        ),
        (proto_group("a", temperature=-0.5), r"temperature \(-0.5\) must be in \[0, 2\]"),
        (proto_group("a", temperature=2.5), r"temperature \(2.5\) must be in \[0, 2\]"),
        (proto_group("a", top_p=0.0), r"top_p \(0.0\) must be in \(0, 1\]"),
        (proto_group("a", top_p=1.5), r"top_p \(1.5\) must be in \(0, 1\]"),
        (proto_group("", n=1), "group_id is empty"),
    ],
)
def test_bad_groups_name_the_field_and_limit(group: pb.PromptGroup, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        validate_submit(submit(group), LIMITS, None)


def test_duplicate_group_ids_in_one_request() -> None:
    with pytest.raises(ValidationError, match="appears twice"):
        validate_submit(submit(proto_group("a"), proto_group("a")), LIMITS, None)


def test_run_id_and_batch_limits() -> None:
    with pytest.raises(ValidationError, match="run_id is empty"):
        validate_submit(submit(proto_group("a"), run_id=""), LIMITS, None)
    with pytest.raises(ValidationError, match="characters"):
        validate_submit(submit(proto_group("a"), run_id="a b"), LIMITS, None)
    with pytest.raises(ValidationError, match="limit per call is 4"):
        validate_submit(submit(*(proto_group(f"g{i}") for i in range(5))), LIMITS, None)
    with pytest.raises(ValidationError, match="groups is empty"):
        validate_submit(submit(), LIMITS, None)


def test_prompt_text_needs_a_tokenizer_and_uses_it() -> None:
    group = pb.PromptGroup(
        group_id="t", prompt_text="hello", n=1, sampling=pb.SamplingParams(max_tokens=4)
    )
    with pytest.raises(ValidationError, match="needs a tokenizer"):
        validate_submit(submit(group), LIMITS, None)
    [spec] = validate_submit(submit(group), LIMITS, lambda text: [ord(c) for c in text])
    assert spec.prompt_token_ids == tuple(ord(c) for c in "hello")


def test_token_ids_outside_the_vocabulary() -> None:
    limits = Limits(
        max_n=8, max_groups_per_submit=4, max_prompt_tokens=100, max_model_len=64, vocab_size=8
    )
    with pytest.raises(ValidationError, match="holds id 9; the vocabulary has 8"):
        validate_submit(
            submit(
                pb.PromptGroup(
                    group_id="v",
                    prompt_token_ids=[1, 9],
                    n=1,
                    sampling=pb.SamplingParams(max_tokens=4),
                )
            ),
            limits,
            None,
        )
    bad = pb.PromptGroup(
        group_id="v", prompt_token_ids=[-1, 2], n=1, sampling=pb.SamplingParams(max_tokens=4)
    )
    with pytest.raises(ValidationError, match="negative id"):
        validate_submit(submit(bad), limits, None)


def test_unknown_context_skips_context_check() -> None:
    limits = Limits(max_n=8, max_groups_per_submit=4, max_prompt_tokens=100, max_model_len=None)
    [spec] = validate_submit(submit(proto_group("a", max_tokens=10_000)), limits, None)
    assert spec.sampling.max_tokens == 10_000


def test_epoch_is_optional_and_in_range() -> None:
    [unset] = validate_submit(submit(proto_group("a")), LIMITS, None)
    assert unset.epoch is None
    group = proto_group("b")
    group.epoch = 3
    [given] = validate_submit(submit(group), LIMITS, None)
    assert given.epoch == 3
    group.epoch = 0
    [zero] = validate_submit(submit(group), LIMITS, None)
    assert zero.epoch == 0
    group.epoch = -1
    with pytest.raises(ValidationError, match=r"groups\[0\] \(b\)\.epoch \(-1\) must be in 0\.\."):
        validate_submit(submit(group), LIMITS, None)
    group.epoch = MAX_EPOCH
    [last] = validate_submit(submit(group), LIMITS, None)
    assert last.epoch == MAX_EPOCH
    group.epoch = MAX_EPOCH + 1
    with pytest.raises(
        ValidationError, match=rf"epoch \({MAX_EPOCH + 1}\) must be in 0\.\.{MAX_EPOCH}"
    ):
        validate_submit(submit(group), LIMITS, None)


def test_a_seed_whose_last_sample_passes_int64_is_refused() -> None:
    group = proto_group("s", n=4)
    group.sampling.seed = 2**63 - 4
    [spec] = validate_submit(submit(group), LIMITS, None)
    assert spec.sampling.seed == 2**63 - 4
    group.sampling.seed = 2**63 - 3
    with pytest.raises(
        ValidationError, match=r"sampling\.seed \(9223372036854775805\) \+ n - 1 \(3\)"
    ):
        validate_submit(submit(group), LIMITS, None)


def test_stop_token_ids_outside_the_vocabulary_are_refused() -> None:
    limits = Limits(
        max_n=8, max_groups_per_submit=4, max_prompt_tokens=100, max_model_len=None, vocab_size=50
    )
    group = proto_group("v")
    group.sampling.stop_token_ids.extend([3, 49])
    [spec] = validate_submit(submit(group), limits, None)
    assert spec.sampling.stop_token_ids == (3, 49)
    group.sampling.stop_token_ids.append(50)
    with pytest.raises(ValidationError, match=r"stop_token_ids holds id 50; the vocabulary has 50"):
        validate_submit(submit(group), limits, None)


def test_stream_samples_is_carried_to_the_spec() -> None:
    [plain] = validate_submit(submit(proto_group("a")), LIMITS, None)
    assert not plain.stream_samples
    group = proto_group("b")
    group.stream_samples = True
    [streaming] = validate_submit(submit(group), LIMITS, None)
    assert streaming.stream_samples


def test_what_a_group_carries_is_bounded() -> None:
    """Each of these is kept in memory and in Redis until the group ends (the prompt key in
    the length history for good): no field is unbounded."""
    sampling = pb.SamplingParams(max_tokens=4)
    cases = [
        (
            pb.PromptGroup(
                group_id="a", prompt_token_ids=[1], n=1, sampling=sampling, prompt_key="k" * 1025
            ),
            r"prompt_key is 1025 characters; the limit is 1024",
        ),
        (
            pb.PromptGroup(
                group_id="a",
                prompt_token_ids=[1],
                n=1,
                sampling=pb.SamplingParams(max_tokens=4, stop=["x"] * 65),
            ),
            r"stop has 65 strings; the limit is 64",
        ),
        (
            pb.PromptGroup(
                group_id="a",
                prompt_token_ids=[1],
                n=1,
                sampling=pb.SamplingParams(max_tokens=4, stop=["x" * 1025]),
            ),
            r"stop holds a string of 1025 characters; the limit is 1024",
        ),
        (
            pb.PromptGroup(
                group_id="a",
                prompt_token_ids=[1],
                n=1,
                sampling=pb.SamplingParams(max_tokens=4, stop_token_ids=[1] * 1025),
            ),
            r"stop_token_ids has 1025 ids; the limit is 1024",
        ),
        (
            # 4 bytes a character in UTF-8: 4,097 characters are over 16 KiB
            pb.PromptGroup(
                group_id="a",
                prompt_token_ids=[1],
                n=1,
                sampling=sampling,
                metadata={"k": "\U0001f642" * 4096},
            ),
            r"metadata holds 16385 bytes \(UTF-8, keys and values\); the limit is 16384",
        ),
    ]
    for group, message in cases:
        with pytest.raises(ValidationError, match=message):
            validate_submit(submit(group), LIMITS, None)
    # At the limits they pass.
    [spec] = validate_submit(
        submit(
            pb.PromptGroup(
                group_id="a",
                prompt_token_ids=[1],
                n=1,
                prompt_key="k" * 1024,
                sampling=pb.SamplingParams(
                    max_tokens=4, stop=["x" * 1024] * 64, stop_token_ids=[1] * 1024
                ),
                metadata={"k": "\U0001f642" * 4095 + "abc"},
            )
        ),
        LIMITS,
        None,
    )
    assert len(spec.sampling.stop) == 64


class Tokenizer:
    """A token a character; keeps the texts it was given."""

    def __init__(self) -> None:
        self.texts: list[str] = []

    def __call__(self, text: str) -> list[int]:
        self.texts.append(text)
        return [1] * len(text)


def test_a_prompt_text_too_long_for_any_tokenizer_is_refused_unread() -> None:
    tokenize = Tokenizer()
    group = pb.PromptGroup(
        group_id="t", prompt_text="x" * 801, n=1, sampling=pb.SamplingParams(max_tokens=4)
    )
    with pytest.raises(
        ValidationError,
        match=r"prompt_text is 801 characters; the limit is 800 \(8 a token of "
        r"max_prompt_tokens, 100\): send prompt_token_ids instead",
    ):
        validate_submit(submit(group), LIMITS, tokenize)
    assert tokenize.texts == []


def test_an_id_that_does_not_print_is_quoted_in_messages() -> None:
    with pytest.raises(ValidationError, match=r"groups\[0\] \('a\\nb'\)\.n \(0,"):
        validate_submit(submit(proto_group("a\nb", n=0)), LIMITS, None)


def test_a_calls_prompt_tokens_are_bounded_before_any_is_read() -> None:
    """A call's prompts are checked, kept and written at once: past the limit it is refused
    before a prompt is read (texts counted at their least, 8 characters a token) and, for
    texts, again once they are tokenized."""
    limits = Limits(
        max_n=8,
        max_groups_per_submit=100,
        max_prompt_tokens=100,
        max_model_len=None,
        max_submit_prompt_tokens=10,
    )
    sampling = pb.SamplingParams(max_tokens=4)
    ids = [
        pb.PromptGroup(group_id=f"g{i}", prompt_token_ids=[1] * 4, n=1, sampling=sampling)
        for i in range(3)
    ]
    with pytest.raises(ValidationError, match=r"groups hold 12 prompt tokens; the limit per "):
        validate_submit(submit(*ids), limits, None)
    tokenize = Tokenizer()
    long_text = pb.PromptGroup(group_id="t", prompt_text="x" * 88, n=1, sampling=sampling)
    with pytest.raises(
        ValidationError,
        match=r"groups hold at least 11 prompt tokens; the limit per call is 10 "
        r"\(max_submit_prompt_tokens\): submit fewer at a time",
    ):
        validate_submit(submit(long_text), limits, tokenize)
    assert tokenize.texts == []
    # Short enough unread, too long once tokenized (a character a token here).
    text = pb.PromptGroup(group_id="t", prompt_text="x" * 11, n=1, sampling=sampling)
    with pytest.raises(ValidationError, match=r"groups hold 11 prompt tokens"):
        validate_submit(submit(text), limits, tokenize)
    [spec] = validate_submit(submit(ids[0]), limits, None)
    assert len(spec.prompt_token_ids) == 4
