"""The engine's ``rollout`` drafter: vLLM speculative decoding with drafts from the sample's
own tokens, its group's siblings and earlier responses to the same prompt.

vLLM loads it as a ``custom_class`` proposer (``speculative_config = {"method":
"custom_class", "model": "rollserve.engine.drafter.RolloutDrafter", ...}``). That interface
hands a proposer the batch's token rows but not which request each row is, nor when a request
finishes, and both are what drafting across requests needs. So the drafter, when vLLM builds
it inside the model runner, wraps two of the runner's methods (once a process, for runners
whose drafter is a :class:`RolloutDrafter`; any other drafter goes through unchanged):

- ``propose_draft_token_ids``: called after every step's bookkeeping, with the batch
  (``input_batch.req_ids`` names the rows) and the draft length vLLM's batch-size schedule
  chose for the step (``num_spec_tokens_to_schedule``; 0 in a step too big to speculate);
- ``_on_request_state_removed``: vLLM's hook when a finished or aborted request's state goes,
  with its prompt and output tokens.

A prompt's corpus is made when its first sample drafts; its earlier outputs (``History``) are
indexed then, in the step, or, when they hold ``background_tokens`` or more, on a thread of
the drafter's (:meth:`PromptCorpus.prepare`), adopted at the first call after it is done (its
samples draft from their own and their siblings' tokens until then): 64 outputs of 28k tokens
took 2 s in the step.

Samples of one prompt are told apart from other prompts by their prompt tokens (the engine
service sends a group's samples, and the same prompt in later epochs, with the same tokens).
Drafting itself is :class:`rollserve.engine.drafting.PromptCorpus`. A sample resumed after a
partial-rollout preemption has its partial response in its prompt, so it drafts from its own
tokens only (and from samples resumed with the very same tokens).

The settings come from ``ROLLSERVE_DRAFTER`` (JSON), which
:func:`rollserve.engine.settings.apply_environment` writes: the engine core is another process
and vLLM passes a custom proposer nothing but its own config.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Any

from rollserve.engine.drafting import DraftSettings, History, PreparedSamples, PromptCorpus

__all__ = [
    "ADD_OUTPUTS_METHOD",
    "DRAFTER_CLASS",
    "DRAFTER_ENV",
    "EXTENSION_CLASS",
    "DrafterConfig",
    "RolloutDrafter",
    "RolloutWorkerExtension",
]

logger = logging.getLogger(__name__)

DRAFTER_CLASS = "rollserve.engine.drafter.RolloutDrafter"
DRAFTER_ENV = "ROLLSERVE_DRAFTER"
EXTENSION_CLASS = "rollserve.engine.drafter.RolloutWorkerExtension"
ADD_OUTPUTS_METHOD = "rollserve_add_earlier_outputs"


@dataclass(frozen=True, slots=True)
class DrafterConfig:
    """What the ``rollout`` drafter needs besides vLLM's config."""

    min_n: int = 2
    max_n: int = 5
    spec_factor: float = 0.0  # see DraftSettings
    min_share: float = 0.0
    # Prompt and output tokens kept of finished samples (4 bytes each): drafting from the last
    # epoch needs this engine's share of an epoch (4,096 prompts x 8 samples of 4k tokens on
    # 8 engines is 16M tokens an engine; replayed through History, 1% of groups found their
    # prompt's history at 4M tokens, 30% at 64M: the others' had run on other engines).
    history_tokens: int = 1 << 26
    history_per_prompt: int = 64  # finished outputs kept a prompt (the newest)
    # A prompt's history of at least this many tokens is indexed on a thread of the drafter's
    # (0: always in the engine's step, as a shorter one is): its samples draft from their own
    # and their siblings' tokens until it is ready, and the step never waits for it.
    background_tokens: int = 1 << 16

    def __post_init__(self) -> None:
        self.draft_settings(1)  # raises for values out of range
        if self.history_tokens < 1 or self.history_per_prompt < 1:
            raise ValueError(
                f"history_tokens ({self.history_tokens}) and history_per_prompt "
                f"({self.history_per_prompt}) must be at least 1"
            )
        if self.background_tokens < 0:
            raise ValueError(
                f"background_tokens ({self.background_tokens}) must be at least 0 (0: never)"
            )

    def draft_settings(self, k: int) -> DraftSettings:
        return DraftSettings(
            k=k,
            min_n=self.min_n,
            max_n=self.max_n,
            spec_factor=self.spec_factor,
            min_share=self.min_share,
        )

    def to_env(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_env(cls) -> DrafterConfig:
        text = os.environ.get(DRAFTER_ENV)
        return cls() if not text else cls(**json.loads(text))


@dataclass(slots=True)
class _Live:
    prompt: tuple[int, ...]
    corpus: PromptCorpus
    seq: int

    @property
    def tokens(self) -> int:
        """Prompt and output tokens indexed so far."""
        return self.corpus.prompt_len + self.corpus.output_len(self.seq)


class RolloutDrafter:
    """vLLM's custom proposer for the ``rollout`` method (built by vLLM with its config)."""

    def __init__(
        self,
        vllm_config: Any,
        config: DrafterConfig | None = None,
        *,
        install_hooks: bool = True,
    ) -> None:
        spec = vllm_config.speculative_config
        config = config or DrafterConfig.from_env()
        self.settings = config.draft_settings(spec.num_speculative_tokens)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.history = History(
            max_tokens=config.history_tokens, max_per_prompt=config.history_per_prompt
        )
        self.background_tokens = config.background_tokens
        self._corpora: dict[tuple[int, ...], PromptCorpus] = {}  # prompts with live samples
        # Histories being indexed on the thread, by prompt; adopted at the next call.
        self._pending: dict[tuple[int, ...], tuple[PromptCorpus, Future[PreparedSamples]]] = {}
        self._executor: ThreadPoolExecutor | None = None
        self.background_builds = 0  # histories indexed on the thread and adopted
        self._live: dict[str, _Live] = {}
        self._live_per_prompt: Counter[tuple[int, ...]] = Counter()
        self.failures = 0  # calls that raised (logged; the step ran without drafts)
        if install_hooks:
            install_runner_hooks()

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """No model to load (vLLM calls this on every drafter)."""

    def propose(self, *args: Any, **kwargs: Any) -> list[list[int]]:
        """vLLM's plain custom-proposer call, which does not say which request a row is;
        the runner hook calls :meth:`propose_rows` instead, so reaching this is a bug."""
        raise RuntimeError(
            "RolloutDrafter.propose was called without the request ids; the model runner's "
            "propose_draft_token_ids is not wrapped (install_runner_hooks), which this vLLM "
            "version may have renamed"
        )

    def propose_rows(
        self, k: int, batch: Any, sampled_token_ids: Sequence[Sequence[int]]
    ) -> list[list[int]]:
        """Drafts for the next step, a row of ``batch`` (vLLM's input batch) each: at most
        ``k`` tokens, none for rows that sampled nothing this step (a prefill in chunks)."""
        if self._pending:
            self._adopt_ready()
        if k < 1:
            return [[] for _ in sampled_token_ids]
        token_ids = batch.token_ids_cpu
        drafts: list[list[int]] = []
        for row, sampled in enumerate(sampled_token_ids):
            total = int(batch.num_tokens_no_spec[row])
            room = min(k, self.max_model_len - total - 1)
            if not sampled or room < 1:
                drafts.append([])
                continue
            req_id = batch.req_ids[row]
            live = self._live.get(req_id)
            prompt_len = int(batch.num_prompt_tokens[row])
            if live is not None and (live.corpus.prompt_len != prompt_len or total < live.tokens):
                # vLLM replaced the request's prompt (a streaming session folds outputs into
                # it): a new sample as far as drafting goes
                self._drop(req_id)
                live = None
            if live is None:
                live = self._start(req_id, tuple(token_ids[row, :prompt_len].tolist()))
            if total > live.tokens:
                live.corpus.extend(live.seq, token_ids[row, live.tokens : total].tolist())
            drafts.append(list(live.corpus.match(live.seq, room).draft))
        return drafts

    def finished(
        self, req_id: str, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int]
    ) -> None:
        """A request finished or was aborted: its output joins the prompt's history."""
        output = [t for t in output_token_ids if t >= 0]  # -1: a placeholder never filled
        live = self._live.get(req_id)
        if live is None:  # it never drafted: as an output made elsewhere
            self.add_outputs(prompt_token_ids, [output])
            return
        have = live.corpus.output_len(live.seq)
        if len(output) > have:  # the siblings still running draft from it
            live.corpus.extend(live.seq, output[have:])
        self._drop(req_id)
        self.history.add(live.prompt, output)

    def add_outputs(
        self, prompt_token_ids: Sequence[int], outputs: Sequence[Sequence[int]]
    ) -> None:
        """Earlier outputs of ``prompt_token_ids`` made elsewhere (another engine, as the
        scheduler tells): they join the prompt's history, and the corpus of its running
        samples, as this engine's own finished outputs do."""
        prompt = tuple(prompt_token_ids)
        corpus = self._corpora.get(prompt)
        if corpus is not None:  # its running samples draft from them from now on
            corpus.add_samples(outputs)
        for output in outputs:
            self.history.add(prompt, output)

    @property
    def live_requests(self) -> int:
        return len(self._live)

    @property
    def live_prompts(self) -> int:
        return len(self._corpora)

    def _drop(self, req_id: str) -> None:
        """Stops tracking a request; its prompt's corpus goes with its last running sample
        (the history keeps what later samples need)."""
        live = self._live.pop(req_id)
        self._live_per_prompt[live.prompt] -= 1
        if self._live_per_prompt[live.prompt] <= 0:
            del self._live_per_prompt[live.prompt]
            del self._corpora[live.prompt]
            pending = self._pending.pop(live.prompt, None)
            if pending is not None:
                pending[1].cancel()  # if it runs already, its result is dropped

    def settle(self, timeout: float | None = None) -> None:
        """Waits for the histories being indexed on the thread and adopts them (tests,
        benchmarks: the engine's step never waits)."""
        if self._pending:
            wait_futures([future for _, future in self._pending.values()], timeout)
            self._adopt_ready()

    def _adopt_ready(self) -> None:
        for prompt, (corpus, future) in list(self._pending.items()):
            if not future.done():
                continue
            del self._pending[prompt]
            try:
                corpus.adopt(future.result())
                self.background_builds += 1
            except Exception:  # the prompt's samples draft without their history
                self.failures += 1
                logger.exception("rollout drafter failed to index a prompt's history")

    def _start(self, req_id: str, prompt: tuple[int, ...]) -> _Live:
        corpus = self._corpora.get(prompt)
        if corpus is None:
            outputs = self.history.outputs(prompt)
            tokens = sum(len(output) for output in outputs)
            if self.background_tokens and tokens >= self.background_tokens:
                # 64 outputs of 28k tokens take ~2 s to index: not in the engine's step.
                corpus = PromptCorpus(prompt, self.settings, index_prompt=False)
                seqs = corpus.reserve(len(outputs))
                if self._executor is None:
                    self._executor = ThreadPoolExecutor(1, thread_name_prefix="rollout-drafter")
                future = self._executor.submit(corpus.prepare, outputs, seqs)
                self._pending[prompt] = (corpus, future)
            else:
                corpus = PromptCorpus(prompt, self.settings)
                corpus.add_samples(outputs)  # one block, indexed by numpy
            self._corpora[prompt] = corpus
        live = _Live(prompt, corpus, corpus.add_sample())
        self._live[req_id] = live
        self._live_per_prompt[prompt] += 1
        return live


class RolloutWorkerExtension:
    """Mixed into vLLM's worker (``worker_extension_cls``) on engines that draft with the
    ``rollout`` method, so that the engine service reaches the drafter in the engine core by
    ``collective_rpc(ADD_OUTPUTS_METHOD, ...)``."""

    def rollserve_add_earlier_outputs(
        self, prompts: list[tuple[list[int], list[list[int]]]]
    ) -> int:
        """Hands each ``(prompt, outputs)`` to the drafter; the count of outputs it took (0:
        the worker's drafter is not the rollout drafter)."""
        runner = getattr(self, "model_runner", None)
        drafter = getattr(runner, "drafter", None)
        if not isinstance(drafter, RolloutDrafter):
            return 0
        for prompt, outputs in prompts:
            drafter.add_outputs(prompt, outputs)
        return sum(len(outputs) for _, outputs in prompts)


_HOOKED = "_rollserve_rollout_drafter_hooks"


def install_runner_hooks() -> None:
    """Wraps vLLM's model runner so that a :class:`RolloutDrafter` learns which request each
    row is and when requests finish (see the module's docstring); once a process."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if getattr(GPUModelRunner, _HOOKED, False):
        return
    propose = GPUModelRunner.propose_draft_token_ids
    removed = GPUModelRunner._on_request_state_removed

    @functools.wraps(propose)
    def propose_draft_token_ids(
        self: Any, scheduler_output: Any, sampled_token_ids: Any, *args: Any, **kwargs: Any
    ) -> Any:
        drafter = getattr(self, "drafter", None)
        if not isinstance(drafter, RolloutDrafter):
            return propose(self, scheduler_output, sampled_token_ids, *args, **kwargs)
        self._draft_probs = None
        self._draft_prob_req_ids = None
        try:
            return drafter.propose_rows(
                scheduler_output.num_spec_tokens_to_schedule, self.input_batch, sampled_token_ids
            )
        except Exception:  # a drafting bug must not take the engine down: no drafts this step
            drafter.failures += 1
            if drafter.failures == 1:
                logger.exception("rollout drafter failed; this step runs without drafts")
            return [[] for _ in sampled_token_ids]

    @functools.wraps(removed)
    def on_request_state_removed(self: Any, req_id: str, req_state: Any) -> None:
        drafter = getattr(self, "drafter", None)
        if (
            isinstance(drafter, RolloutDrafter)
            and req_state is not None
            and req_state.prompt_token_ids is not None
        ):
            try:
                drafter.finished(req_id, req_state.prompt_token_ids, req_state.output_token_ids)
            except Exception:
                drafter.failures += 1
                logger.exception("rollout drafter failed to keep a finished request")
        removed(self, req_id, req_state)

    GPUModelRunner.propose_draft_token_ids = propose_draft_token_ids
    GPUModelRunner._on_request_state_removed = on_request_state_removed
    setattr(GPUModelRunner, _HOOKED, True)
