"""The sim engine service's one settings object (``rollserve sim engine|fleet --help``)."""

from __future__ import annotations

from pathlib import Path

from pydantic import ConfigDict, Field, field_validator, model_validator
from rollserve.client.address import join_host_port
from rollserve.engine.settings import SchedulerLink
from rollserve.sim.profile import CostProfile, load_profile
from rollserve.sim.responses import LengthModel, load_lengths

__all__ = ["SimSettings"]

MAX_PORT = 65535


class SimSettings(SchedulerLink):
    """Settings of one sim engine, or of a fleet of them in one process.

    Every duration is simulated time except ``shutdown_grace_s``: the engines step in real
    time slowed down (``time_scale`` above 1) or sped up (below 1) from the profile's hardware.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    engine_id: str = Field(
        "sim",
        min_length=1,
        max_length=120,
        description="Name of the engine; in a fleet, engine i is named <engine_id>-<i>.",
    )
    engines: int = Field(1, ge=1, le=4096, description="Engines served by this process.")
    host: str = Field("127.0.0.1", min_length=1, description="Interface the gRPC servers bind.")
    port: int = Field(
        0,
        ge=0,
        le=MAX_PORT,
        description="gRPC port; in a fleet engine i binds port + i; 0 picks free ports.",
    )
    advertise_host: str | None = Field(
        None, min_length=1, description="Host the scheduler should dial (default: host)."
    )
    profile: str = Field(
        "gpu-h100-llama8b",
        min_length=1,
        description="Cost profile: a shipped name (profiles/*.toml) or a TOML file.",
    )
    time_scale: float = Field(
        1.0,
        gt=0,
        le=1000,
        description="Real seconds per simulated second (0.01 runs 100x faster than the profile).",
    )
    response_median: float = Field(
        1000.0, ge=1, le=10_000_000, description="Median response length in tokens."
    )
    prompt_sigma: float = Field(
        0.95, ge=0, le=5, description="Sigma of a prompt's log-length effect (between groups)."
    )
    within_sigma: float = Field(
        0.6, ge=0, le=5, description="Sigma of a sample's log-length effect (within a group)."
    )
    lengths_file: Path | None = Field(
        None,
        description="CSV prompt_hash,response_len: lengths of the prompts it lists (optional).",
    )
    seed: int = Field(0, ge=0, le=2**62, description="Seed of the length model and the tokens.")
    vocab_size: int = Field(
        128256, ge=2, le=2**31 - 1, description="Token ids are below it (Llama-3's by default)."
    )
    eos_token_id: int = Field(
        128001, ge=0, le=2**31 - 2, description="Last token of a sample that stops by itself."
    )
    max_model_len: int = Field(
        32768, ge=16, le=16_777_216, description="Context length: prompt plus response tokens."
    )
    flush_interval_ms: float = Field(
        2000.0,
        gt=0,
        le=60_000,
        description=(
            "Simulated ms between an engine's flush ticks (x time_scale), at which every call "
            "sends its new tokens; a sample's end is sent at once, as the real engine service "
            "does."
        ),
    )
    shutdown_grace_s: float = Field(
        5.0, ge=0, le=600, description="On SIGTERM, how long running Generate calls may finish."
    )
    stats_path: Path | None = Field(
        None, description="On exit, write the fleet's totals (JSON) here (optional)."
    )

    @field_validator("profile")
    @classmethod
    def _profile_loads(cls, value: str) -> str:
        load_profile(value)  # its ValueError names the profile and the shipped ones
        return value

    @field_validator("lengths_file")
    @classmethod
    def _lengths_file_reads(cls, value: Path | None) -> Path | None:
        if value is None:
            return None
        if not value.is_file():
            raise ValueError(f"lengths_file ({value}) is not a file")
        load_lengths(value)
        return value.resolve()

    @model_validator(mode="after")
    def _consistent(self) -> SimSettings:
        if self.eos_token_id >= self.vocab_size:
            raise ValueError(
                f"eos_token_id ({self.eos_token_id}) must be below vocab_size ({self.vocab_size})"
            )
        profile = load_profile(self.profile)
        usable = profile.num_blocks * profile.block_size  # (whole blocks: what the engine has)
        if self.max_model_len > usable:
            raise ValueError(
                f"max_model_len ({self.max_model_len}) exceeds the KV capacity of profile "
                f"{profile.name} ({usable} tokens in whole blocks): one sample would not fit; "
                "lower max_model_len or use a profile with more KV"
            )
        if self.port and self.port + self.engines - 1 > MAX_PORT:
            raise ValueError(
                f"port ({self.port}) + engines ({self.engines}) - 1 exceeds {MAX_PORT}; "
                "use a lower port, or 0 for free ports"
            )
        return self

    def cost_profile(self) -> CostProfile:
        return load_profile(self.profile)

    def length_model(self) -> LengthModel:
        table = load_lengths(self.lengths_file) if self.lengths_file is not None else {}
        return LengthModel(
            self.response_median, self.prompt_sigma, self.within_sigma, self.seed, table
        )

    def engine_name(self, index: int) -> str:
        """The id of engine ``index``: engine_id alone for one engine, else engine_id-index."""
        return self.engine_id if self.engines == 1 else f"{self.engine_id}-{index}"

    def bind_address(self, index: int) -> str:
        """host:port engine ``index`` binds (port 0: a free one, picked at bind time)."""
        return join_host_port(self.host, self.port + index if self.port else 0)

    def advertised_address(self, bound_port: int) -> str:
        """host:port others should dial, once the port is bound."""
        return join_host_port(self.advertise_host or self.host, bound_port)
