"""Load test of the scheduler, driven as RL trainers drive it (Locust, https://locust.io).

Each Locust user is one trainer with a run of its own. One task is one synchronous RL step:

1. it submits ``--groups-per-step`` groups of ``--group-size`` samples over the scheduler's
   HTTP API (``docs/http-api.md``): the next rows of a dataset of ``--prompts`` prompts of
   ``--prompt-tokens`` tokens (half of them a template every prompt shares), taken in order
   and again in the next epoch, each keyed by its row (``prompt_key``, as a trainer keys its
   dataset, so that the scheduler's length history applies), with ``--max-tokens``;
2. it reads them from the run's Redis stream as they finish, in a consumer group, each entry
   acknowledged, as ``rollserve.client`` reads them;
3. once all are in, it publishes the next policy version (no weights).

Besides the HTTP calls, Locust's table then has ``stream / group delivered`` (Submit to the
group's stream entry, per group, as the trainer sees it; its size the group's output
tokens) and ``step / all groups delivered`` (the step's makespan). Failures: a refusal, a
group that failed, and groups not delivered within ``--step-timeout-s`` (then cancelled).
A 429 (the scheduler's queue full) counts as a failure: it says the load is past what the
scheduler was set to hold.

Run against a scheduler with its HTTP port open, for instance a dev stack of simulated
engines (``rollserve up`` prints its Redis URL):

    rollserve up --sim --engines 64 --http-port 9464 &
    locust -f tests/load/locustfile.py --host http://127.0.0.1:9464 --redis-url REDIS_URL \\
        --users 32 --spawn-rate 8 --run-time 5m --headless --stop-timeout 120

``tests/load/test_locust.py`` runs it in CI, small and short.
"""

from __future__ import annotations

import random
import time
import uuid
from typing import Any, cast

import redis
from locust import HttpUser, constant, events, task
from locust.env import Environment
from rollserve.client.wire import GroupStatus, decode_entry, stream_key

CONSUMER_GROUP = "trainer"
VOCAB = 1000  # prompt token ids are drawn below this (the sim engine's vocabulary is larger)


def _options(parser: Any) -> None:
    group = parser.add_argument_group("rollserve")
    group.add_argument("--redis-url", default="redis://127.0.0.1:6379/0", help="the scheduler's")
    group.add_argument("--groups-per-step", type=int, default=16)
    group.add_argument("--group-size", type=int, default=8, help="samples per group (n)")
    group.add_argument("--prompt-tokens", type=int, default=128)
    group.add_argument("--max-tokens", type=int, default=256)
    group.add_argument("--step-timeout-s", type=float, default=300.0)
    group.add_argument("--prompts", type=int, default=1000, help="rows of the dataset")


events.init_command_line_parser.add_listener(_options)  # type: ignore[no-untyped-call]


def _prompt(row: int, tokens: int) -> list[int]:
    """Row ``row`` of the dataset: the template's tokens, then the row's own."""
    template = random.Random("template")  # (not a number: Random(-1) is Random(1))
    own = random.Random(row)
    half = tokens // 2
    return [template.randrange(VOCAB) for _ in range(half)] + [
        own.randrange(VOCAB) for _ in range(tokens - half)
    ]


class Trainer(HttpUser):
    """One trainer: a run of its own, synchronous steps back to back."""

    wait_time = constant(0)

    def on_start(self) -> None:
        self.run_id = f"load-{uuid.uuid4().hex[:12]}"
        self.stream = stream_key(self.run_id)
        self.redis = redis.Redis.from_url(self.options.redis_url)
        self.redis.xgroup_create(self.stream, CONSUMER_GROUP, id="0", mkstream=True)
        self.steps = 0  # steps delivered whole: the policy versions published
        self.submits = 0  # Submits taken: their groups' ids and rows are never given again

    def on_stop(self) -> None:
        # The run ends: the scheduler cancels what is left of it and deletes its state.
        with self.client.delete(
            f"/v1/runs/{self.run_id}", name="/v1/runs/[run]", catch_response=True
        ) as reply:
            if reply.status_code != 200:
                reply.failure(f"{reply.status_code}: {reply.text[:300]}")
        self.redis.close()

    @property
    def options(self) -> Any:
        environment: Environment = self.environment
        return environment.parsed_options

    @task
    def step(self) -> None:
        started = time.perf_counter()
        ids = self._submit()
        if not ids:
            return
        submitted = {group_id: started for group_id in ids}
        pending = self._read(submitted, deadline=started + self.options.step_timeout_s)
        if pending:
            self._fire(
                "step",
                "all groups delivered",
                started,
                0,
                f"{len(pending)} of "
                f"{len(ids)} groups not delivered in {self.options.step_timeout_s:g} s",
            )
            self._post(f"/v1/runs/{self.run_id}/cancel", {"group_ids": sorted(pending)}, "cancel")
            return
        self._fire("step", "all groups delivered", started, len(ids), None)
        self.steps += 1
        self._post(f"/v1/runs/{self.run_id}/versions", {"version": self.steps}, "versions")

    def _submit(self) -> list[str]:
        """Submits one step's groups; their ids, or none if the call was refused."""
        options = self.options
        groups = []
        for i in range(options.groups_per_step):
            epoch, row = divmod(self.submits * options.groups_per_step + i, options.prompts)
            groups.append(
                {
                    "group_id": f"s{self.submits}-g{i}",
                    "prompt_token_ids": _prompt(row, options.prompt_tokens),
                    "n": options.group_size,
                    "prompt_key": f"row-{row}",
                    "epoch": epoch,
                    "sampling": {"temperature": 1.0, "max_tokens": options.max_tokens},
                }
            )
        if not self._post(f"/v1/runs/{self.run_id}/groups", {"groups": groups}, "groups"):
            return []
        self.submits += 1
        return [g["group_id"] for g in groups]

    def _post(self, path: str, body: dict[str, Any], name: str) -> bool:
        with self.client.post(
            path, json=body, name=f"/v1/runs/[run]/{name}", catch_response=True
        ) as reply:
            if reply.status_code != 200:
                reply.failure(f"{reply.status_code}: {reply.text[:300]}")
                return False
        return True

    def _read(self, submitted: dict[str, float], deadline: float) -> set[str]:
        """Reads the run's stream until every submitted group is in or ``deadline`` passes;
        the ids still pending."""
        pending = set(submitted)
        while pending and time.perf_counter() < deadline:
            block_ms = max(1, int(min(1.0, deadline - time.perf_counter()) * 1000))
            replies = cast(
                list[tuple[bytes, list[tuple[bytes, dict[bytes, bytes]]]]] | None,
                self.redis.xreadgroup(
                    CONSUMER_GROUP, "c", {self.stream: ">"}, count=256, block=block_ms
                ),
            )
            for _, entries in replies or []:
                for entry_id, fields in entries:
                    result = decode_entry(fields)
                    self.redis.xack(self.stream, CONSUMER_GROUP, entry_id)
                    if result.group_id not in pending:
                        continue  # (read before: a consumer sees each entry once)
                    pending.discard(result.group_id)
                    failed = result.status is not GroupStatus.DELIVERED
                    self._fire(
                        "stream",
                        "group delivered",
                        submitted[result.group_id],
                        result.num_output_tokens,
                        f"group {result.group_id} failed: {result.error}" if failed else None,
                    )
        return pending

    def _fire(self, kind: str, name: str, since: float, size: int, error: str | None) -> None:
        self.environment.events.request.fire(
            request_type=kind,
            name=name,
            response_time=(time.perf_counter() - since) * 1000,
            response_length=size,
            exception=None if error is None else RuntimeError(error),
            context={},
        )
