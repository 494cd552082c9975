"""The scheduler's settings: one object, each field with a default, bounds and a description."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from rollserve.client.wire import ENGINE_ID_PATTERN, MAX_SAMPLES_PER_CALL
from rollserve.common.access import BearerFile, ClientTls, ServerTls, TokenFile
from rollserve.scheduler.core.policy import DEFAULT_POLICY, policy_names
from rollserve.scheduler.core.predictor import PredictorSettings
from rollserve.scheduler.engines import EngineTls
from rollserve.scheduler.roles import ROLES
from rollserve.scheduler.validation import MAX_SUBMIT_PROMPT_TOKENS


class EngineEndpoint(BaseModel):
    model_config = ConfigDict(frozen=True)

    engine_id: str = Field(min_length=1, max_length=128, pattern=ENGINE_ID_PATTERN)
    address: str = Field(min_length=3, description="host:port the scheduler dials")

    @classmethod
    def parse(cls, text: str, index: int) -> EngineEndpoint:
        """``ID=HOST:PORT`` or ``HOST:PORT`` (then the id is ``engine-<index>``)."""
        engine_id, sep, address = text.partition("=")
        if not sep:
            engine_id, address = f"engine-{index}", text
        return cls(engine_id=engine_id, address=address)


class SchedulerSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    host: str = Field("127.0.0.1", description="address the gRPC server binds")
    port: int = Field(50051, ge=0, le=65535, description="gRPC port; 0 picks a free one")
    http_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="port on host of the HTTP API (JSON, /v1/...) and the Prometheus endpoint "
        "(GET /metrics); 0 picks a free one; None serves none",
    )
    max_grpc_message_bytes: int = Field(
        64 * 2**20,
        ge=1024,
        le=2**31 - 1,
        description="largest gRPC message the scheduler's server reads (a larger one is "
        "refused with RESOURCE_EXHAUSTED before it is parsed): a Submit of 8 Mi prompt tokens "
        "(max_submit_prompt_tokens) takes about 24 MiB; parsed on the event loop, a message "
        "of 250 MiB held it for 2 s",
    )
    max_http_body_bytes: int = Field(
        32 * 2**20,
        ge=1024,
        le=2**31,
        description="largest request body the HTTP API reads (a larger one is answered 413); "
        "a Submit's JSON takes about 7 bytes a prompt token",
    )
    tls_cert_file: str | None = Field(
        None,
        description="PEM certificate chain of the gRPC and HTTP servers, which then take TLS "
        "connections only (with tls_key_file); read again when it changes (renewed without a "
        "restart); None: plaintext",
    )
    tls_key_file: str | None = Field(None, description="PEM key of tls_cert_file")
    tls_client_ca_file: str | None = Field(
        None,
        description="PEM CA certificates: callers must show a certificate one of them signed "
        "(mutual TLS; needs tls_cert_file); None: callers show none",
    )
    auth_tokens_file: str | None = Field(
        None,
        description="file of 'NAME:TOKEN [role=ROLE] [runs=GLOB,...]' lines: every call (gRPC "
        "and HTTP; not health checks, reflection, /metrics nor /openapi.json) must carry one as "
        "'authorization: Bearer TOKEN', engines' registrations included, and stay within its "
        "role (admin, trainer, engine, viewer) and runs; read again when it changes; None: no "
        "token asked",
    )
    engine_token_file: str | None = Field(
        None,
        description="file holding the token (alone) that every call to the engines carries, "
        "for engines started with --auth-tokens-file; read again when it changes; None: no "
        "token sent",
    )
    engine_ca_file: str | None = Field(
        None,
        description="PEM CA certificates that signed the engines' (engines started with "
        "--tls-cert-file): the scheduler reaches the engines over TLS; None: plaintext",
    )
    engine_cert_file: str | None = Field(
        None,
        description="PEM certificate chain the scheduler shows engines that ask for one "
        "(engines started with --tls-client-ca-file: mutual TLS; with engine_key_file, needs "
        "engine_ca_file); read again when it changes, as is engine_ca_file",
    )
    engine_key_file: str | None = Field(None, description="PEM key of engine_cert_file")
    engine_tls_server_name: str | None = Field(
        None,
        min_length=1,
        description="the name the engines' certificates must carry, where it is not the "
        "host of their addresses (engines addressed by IP); needs engine_ca_file",
    )
    redis_url: str = Field(description="Redis the scheduler keeps its state and streams in")
    engines: tuple[EngineEndpoint, ...] = Field(
        (), description="engines known at start; more may register over gRPC"
    )
    policy: str = Field(DEFAULT_POLICY, description="placement policy")
    cost_profile: str | None = Field(
        None,
        description="the engines' step costs for the rl policy's cost model: a shipped profile "
        "name (cpu-tiny, gpu-h100-llama8b) or a profile TOML; None: GPU-class defaults",
    )
    tokenizer: str | None = Field(
        None, description="model dir whose tokenizer.json tokenizes prompt_text"
    )
    max_queued_groups: int = Field(
        100_000, ge=1, description="groups waiting for an engine before Submit is refused"
    )
    max_held_prompt_tokens: int = Field(
        64 * 2**20,
        ge=1,
        description="prompt tokens of the groups not yet delivered (queued or running) before "
        "Submit is refused: the scheduler keeps them in memory (about 40 bytes a token)",
    )
    max_groups_per_submit: int = Field(10_000, ge=1, description="groups in one Submit call")
    max_submit_prompt_tokens: int = Field(
        MAX_SUBMIT_PROMPT_TOKENS,
        ge=1,
        description="prompt tokens in one Submit call: the scheduler checks, keeps and writes a "
        "call's prompts at once (about 0.3 s a million tokens), and its lease waits meanwhile",
    )
    max_n: int = Field(
        64,
        ge=1,
        le=MAX_SAMPLES_PER_CALL,  # (an engine takes a group's n in one call)
        description="samples per group",
    )
    max_prompt_tokens: int = Field(131_072, ge=1, description="prompt length in tokens")
    max_model_len: int | None = Field(
        None, ge=2, description="context length; None learns it from the engines (their minimum)"
    )
    nice: int = Field(
        0,
        ge=0,
        le=19,
        description="niceness of the scheduler's threads (let CPU engines on the host go first)",
    )
    fair_share: bool = Field(
        True,
        description="runs with groups queued share the engines' slots evenly (each its share "
        "before any more than its share, and the engines' own queues in fair-queuing order; "
        "rollserve.scheduler.core.fairshare); False: runs go in arrival order at each "
        "priority level, and engines take calls in arrival order",
    )
    capacity_factor: float = Field(
        1.25,
        gt=0,
        le=16,
        description="samples in flight per engine, as a multiple of its max_num_seqs",
    )
    plan_pace_from_s: float = Field(
        0.02,
        ge=0,
        le=10,
        description="a plan that took longer is followed by a wait as long (a quarter second "
        "at most), so that plans of a deep queue leave the scheduler time for its calls, "
        "streams and Submits",
    )
    max_attempts: int = Field(
        3,
        ge=1,
        le=100,
        description="dispatches of a group before it is reported failed (resuming a "
        "preempted sample is not one; counted in memory: a restarted scheduler counts anew)",
    )
    health_interval_s: float = Field(1.0, gt=0, le=60, description="engine probe period")
    health_timeout_s: float = Field(2.0, gt=0, le=60, description="engine probe deadline")
    health_failures: int = Field(
        2, ge=1, le=100, description="consecutive failed probes that mark an engine unhealthy"
    )
    health_watched_every: int = Field(
        5,
        ge=1,
        le=1000,
        description="probe a healthy engine whose health watch is open every this many "
        "periods (its status changes and its exit arrive through the watch at once; the "
        "probe finds a hung engine)",
    )
    weights_timeout_s: float = Field(
        600.0,
        gt=0,
        le=86_400,
        description="deadline of one engine's weight update (UpdateWeights: a checkpoint read "
        "from disk into the running model)",
    )
    label_on_arrival: bool = Field(
        False,
        description="a PublishVersion without weights labels the tokens the scheduler receives "
        "from then on, without asking the engines what each sample had made (no Stats calls "
        "at publishes; tokens sent after it but made before it get the new version)",
    )
    forget_fleet_weights: bool = Field(
        False,
        description="at start, forget the weights a PublishVersion of an earlier run made the "
        "fleet's (kept in Redis), so that engines serve the weights they were launched with",
    )
    max_engines: int = Field(
        4096, ge=1, le=65_536, description="engines in the fleet before RegisterEngine is refused"
    )
    forget_engine_after_s: float = Field(
        300.0,
        gt=0,
        description="a registered engine that is down and sent no heartbeat for this long (and "
        "for at least five heartbeat periods) leaves the fleet; engines of the settings stay",
    )
    heartbeat_interval_ms: int = Field(
        2000,
        ge=100,
        le=600_000,
        description="heartbeat period told to engines (the least; it grows with the fleet to "
        "keep within max_heartbeats_per_s)",
    )
    max_heartbeats_per_s: float = Field(
        50.0,
        gt=0,
        le=100_000,
        description="heartbeats a second from all registered engines together, at most: the "
        "period told to each engine is at least engines / this",
    )
    earlier_outputs_per_prompt: int = Field(
        64,
        ge=0,
        le=256,
        description="finished outputs of each prompt kept to hand to engines that draft from "
        "them (the rollout drafter, which keeps 64 a prompt) and did not make them; 0: none "
        "kept nor sent",
    )
    earlier_outputs_push: bool = Field(
        True,
        description="send finished outputs to the engines running other samples of their "
        "group that draft from such outputs (AddOutputs), rather than with their next call "
        "only",
    )
    earlier_outputs_push_interval_s: float = Field(
        1.0,
        gt=0,
        le=3600,
        description="an engine gets such outputs at most once this often (each AddOutputs "
        "pauses a vLLM engine for about a step)",
    )
    earlier_outputs_tokens: int = Field(
        1 << 26,
        ge=1,
        description="tokens of those outputs kept in all (4 bytes each, 256 MiB at the "
        "default, as much as one engine's drafter keeps; the prompt used least recently goes "
        "first)",
    )
    redis_max_connections: int = Field(
        64,
        ge=2,
        le=10_000,
        description="connections to Redis at most; more concurrent writes wait for one",
    )
    stream_maxlen: int = Field(
        0,
        ge=0,
        description="approximate cap of a run's stream length, which drops entries whether "
        "or not they were read; 0: no cap",
    )
    trim_acked: bool = Field(
        True,
        description="remove from a run's stream the entries every consumer group has "
        "acknowledged, once acked_retention_s old (a long run's stream holds what is still "
        "to be read, not every group it delivered)",
    )
    acked_retention_s: float = Field(
        300.0,
        ge=0,
        le=10**7,
        description="age of an acknowledged entry before it is removed (trim_acked)",
    )
    trim_interval_s: float = Field(
        10.0, gt=0, le=3600, description="how often the streams are trimmed (trim_acked)"
    )
    shutdown_grace_s: float = Field(5.0, ge=0, le=600, description="grace period on SIGTERM")
    lease_ttl_s: float = Field(
        10.0,
        ge=0.5,
        le=600,
        description="life of the scheduler's lease on its Redis database, renewed every tenth",
    )
    lease_wait_s: float = Field(
        15.0,
        ge=0,
        le=3600,
        description="how long a starting scheduler waits for another's lease to end; 0: not at all",
    )
    predictor: PredictorSettings = Field(
        default_factory=PredictorSettings,
        description="response-length predictor (see rollserve.scheduler.core.predictor)",
    )
    predictor_namespace: str = Field(
        "default",
        min_length=1,
        max_length=128,
        pattern=r"^[A-Za-z0-9_.-]+$",
        description="Redis namespace of the length history: one per model or experiment",
    )

    @field_validator("cost_profile")
    @classmethod
    def _loadable_profile(cls, value: str | None) -> str | None:
        if value is not None:
            from rollserve.sim.profile import load_profile

            load_profile(value)  # its ValueError names the file and what is wrong
        return value

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, value: str) -> str:
        if value not in policy_names():
            raise ValueError(f"policy {value!r} is unknown; known: {', '.join(policy_names())}")
        return value

    @model_validator(mode="after")
    def _http_port_is_not_the_grpc_port(self) -> SchedulerSettings:
        if self.http_port and self.http_port == self.port:
            raise ValueError(f"http_port ({self.http_port}) is the gRPC port; give it another")
        return self

    @model_validator(mode="after")
    def _readable_credentials(self) -> SchedulerSettings:
        self.server_tls()  # (its errors name the setting, or the file and what is wrong)
        self.token_file()
        self.engine_token()
        if self.engine_tls_server_name is not None and self.engine_ca_file is None:
            raise ValueError("engine_tls_server_name needs engine_ca_file: it is a TLS setting")
        if (self.engine_cert_file is None) != (self.engine_key_file is None):
            raise ValueError(
                "engine_cert_file and engine_key_file: give both (mutual TLS) or neither"
            )
        if self.engine_cert_file is not None and self.engine_ca_file is None:
            raise ValueError(
                "engine_cert_file needs engine_ca_file: the certificate is shown over TLS"
            )
        self.engine_tls()
        return self

    def server_tls(self) -> ServerTls | None:
        """The servers' TLS (files read and checked now); None: plaintext."""
        return ServerTls.from_settings(
            self.tls_cert_file, self.tls_key_file, self.tls_client_ca_file
        )

    def token_file(self) -> TokenFile | None:
        """The tokens calls must carry (read now); None: none asked."""
        if self.auth_tokens_file is None:
            return None
        return TokenFile(self.auth_tokens_file, roles=ROLES)

    def engine_tls(self) -> EngineTls | None:
        """How the engines are reached over TLS (the files read and checked now, and again
        when they change); None: plaintext."""
        if self.engine_ca_file is None:
            return None
        client = ClientTls(
            self.engine_ca_file,
            self.engine_cert_file,
            self.engine_key_file,
            names=("engine_ca_file", "engine_cert_file", "engine_key_file"),
        )
        return EngineTls(client, self.engine_tls_server_name)

    def engine_token(self) -> BearerFile | None:
        """The token the engines' API is called with (read now); None: none sent."""
        return None if self.engine_token_file is None else BearerFile(self.engine_token_file)

    @model_validator(mode="after")
    def _lease_outwaits_a_crash(self) -> SchedulerSettings:
        # A scheduler restarted at once after a crash finds the dead one's lease for up to a
        # ttl: a wait shorter than that (but not none) would fail such a restart by chance.
        if 0 < self.lease_wait_s < self.lease_ttl_s:
            raise ValueError(
                f"lease_wait_s ({self.lease_wait_s:g}) is shorter than lease_ttl_s "
                f"({self.lease_ttl_s:g}): a scheduler restarted after a crash could fail to "
                "start; raise lease_wait_s to at least lease_ttl_s, or set it to 0 to fail at once"
            )
        return self
