"""Who may call the scheduler: bearer tokens (``--auth-tokens-file``), TLS and mutual TLS
(``--tls-*``), over gRPC and HTTP, with the SDK, an engine's registration and ``rollserve
status`` as the callers (``rollserve.common.access``, ``rollserve.client.credentials``).

Faked: nothing over the wire (the scheduler is served as ``rollserve scheduler`` serves it, on
the session's Redis, with no engine but those a test registers); the tokens file's reload runs
on a fake clock. Certificates are made for each test (``tests.unit.certs``).
"""

from __future__ import annotations

import asyncio
import ssl
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
from aiohttp import web
from google.protobuf import json_format
from grpc_health.v1 import health as health_aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pydantic import ValidationError
from rich.console import Console
from rollserve.cli.stack import StackConfig, free_port
from rollserve.cli.status import UNREACHABLE_EXIT_CODE, run_status
from rollserve.client import (
    AsyncRolloutClient,
    GroupStatus,
    PermissionDenied,
    PromptGroup,
    RolloutClient,
    SamplingParams,
    SchedulerCredentials,
    SchedulerUnavailable,
    Unauthenticated,
)
from rollserve.client.credentials import NO_CREDENTIALS
from rollserve.common.access import (
    RELOAD_INTERVAL_S,
    ClientTls,
    Grant,
    ServerTls,
    TokenFile,
    parse_tokens,
)
from rollserve.engine.server import (
    AioHealthServicer,
    serve_metrics,
    set_health,
    stay_registered,
)
from rollserve.engine.settings import EngineSettings, SchedulerLink
from rollserve.scheduler.engines import EngineHandle, EngineTls
from rollserve.scheduler.roles import ROLES
from rollserve.scheduler.settings import EngineEndpoint, SchedulerSettings
from rollserve.sim.server import FleetStarted
from rollserve.sim.server import parse_settings as sim_parse_settings
from rollserve.sim.server import serve as sim_serve
from rollserve.sim.settings import SimSettings
from rollserve.v1 import rollserve_pb2 as pb
from rollserve.v1 import rollserve_pb2_grpc as pb_grpc

from tests.served import ServedScheduler, served_scheduler
from tests.unit.builders import spec
from tests.unit.certs import Pki, encrypt_key, make_pki

TIMEOUT_S = 30.0
TOKEN = "trainer-token-0123456789abcdef"
ENGINE_TOKEN = "engine-token-0123456789abcdef"
SECRET = "s3cr3t-never-shown-0123456789"


@pytest.fixture
def tokens_file(tmp_path: Path) -> Path:
    path = tmp_path / "tokens"
    path.write_text(f"# who may call\ntrainer:{TOKEN}\n\nengines:{ENGINE_TOKEN}\n")
    return path


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return make_pki(tmp_path)


@asynccontextmanager
async def scheduler(redis_url: str, **given: Any) -> AsyncIterator[tuple[ServedScheduler, int]]:
    """A scheduler served with ``given`` settings and an HTTP port: (it, the HTTP port)."""
    http_port = free_port()
    settings = SchedulerSettings(
        port=0,
        http_port=http_port,
        redis_url=redis_url,
        predictor_namespace=f"ns-{uuid.uuid4().hex[:10]}",
        shutdown_grace_s=0.0,
        **given,
    )
    async with served_scheduler(settings, TIMEOUT_S) as served:
        yield served, http_port


@asynccontextmanager
async def sim_engine(settings: SimSettings) -> AsyncIterator[str]:
    """A sim engine served with ``settings``: its address."""
    stop = asyncio.Event()
    started: asyncio.Future[FleetStarted] = asyncio.get_running_loop().create_future()
    fleet = asyncio.create_task(sim_serve(settings, ready=started.set_result, stop=stop))
    try:
        yield (await asyncio.wait_for(started, TIMEOUT_S)).addresses[settings.engine_id]
    finally:
        stop.set()
        await asyncio.wait_for(fleet, TIMEOUT_S)


def group(group_id: str) -> PromptGroup:
    return PromptGroup(
        group_id=group_id, prompt_token_ids=[1, 2, 3], n=2, sampling=SamplingParams(max_tokens=4)
    )


async def delivered(trainer: AsyncRolloutClient, group_id: str) -> None:
    """Submits one group and reads it back delivered."""
    assert await trainer.submit([group(group_id)]) == 1
    async for item in trainer.groups(limit=1, timeout_s=TIMEOUT_S):
        assert item.result.status == GroupStatus.DELIVERED, item.result.error
        await item.done()


def client(
    redis_url: str, port: int, credentials: SchedulerCredentials = NO_CREDENTIALS
) -> AsyncRolloutClient:
    return AsyncRolloutClient(
        f"localhost:{port}",
        redis_url,
        f"run-{uuid.uuid4().hex[:8]}",
        credentials=credentials,
        rpc_timeout_s=10.0,
    )


# ------------------------------------------------------------------ tokens file


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("", "no token in it"),
        ("# only a comment\n", "no token in it"),
        (f"{SECRET}\n", "line 1: expected NAME:TOKEN"),
        (f"bad name:{SECRET}\n", "line 1: the name must be 1 to 64"),
        ("short:abc\n", "line 1: the token must be 16 to 4096"),
        (f"x:{SECRET} tail\n", "none of role=ROLE, runs=GLOB,... and engines=GLOB"),
        (f"x:0123456789abcdef {SECRET}\n", "none of role=ROLE"),  # (not shown)
        (f"x:{SECRET} role=root\n", "line 1: role 'root' is not one of admin"),
        (f"x:{SECRET} role=admin role=admin\n", "role= is given twice"),
        (f"x:{SECRET} runs=a-*,b/c\n", "runs= takes run ids or globs of them"),
        (f"x:{SECRET} runs=\n", "not ''"),
        (f"x:{SECRET} engines=sim-*,\n", "engines= takes engine ids"),
        # A token left out (a template's empty variable): its options are no token.
        ("x: runs=alice-experiments-* role=trainer\n", "line 1: no token after the name 'x'"),
        ("x:runs=alice-experiments-*\n", "line 1: no token after the name 'x'"),
        (f"x: {SECRET}\n", "no token after the name 'x': NAME:TOKEN, no space"),
        ("x:\n", "no token after the name 'x'"),
        # A name as long as a token is never shown (a token and its name swapped).
        (f"{SECRET}:trainer\n", "line 1: the token must be"),
        (f"{SECRET}+/=:0123456789abcdef\n", "line 1: the name must be"),
        (f"{SECRET}:{TOKEN}\n{SECRET}:{TOKEN}x\n", "line 2: the name is line 1's too"),
        (f"a:{SECRET}\n\na:{SECRET}x\n", "line 3: the name 'a' is line 1's too"),
        (f"a:{SECRET}\nb:{SECRET}\n", "line 2: the token is line 1's too"),
    ],
)
def test_a_tokens_file_that_does_not_parse_is_refused_naming_the_line(text: str, said: str) -> None:
    with pytest.raises(ValueError, match=r"^tokens\.txt") as raised:
        parse_tokens(text, "tokens.txt")
    assert said in str(raised.value)
    assert SECRET not in str(raised.value)


def test_a_call_is_told_whose_token_it_carries_or_why_it_is_refused(tokens_file: Path) -> None:
    tokens = TokenFile(tokens_file)
    assert tokens.names == ("engines", "trainer")
    assert tokens.caller(f"Bearer {TOKEN}") == (Grant("trainer"), "")
    assert tokens.caller(f"bearer  {ENGINE_TOKEN} ") == (Grant("engines"), "")
    assert tokens.caller(None)[1].startswith("no credentials")
    assert tokens.caller(TOKEN)[1] == "the authorization must read 'Bearer <token>'"
    assert tokens.caller(f"Basic {TOKEN}")[1] == "the authorization must read 'Bearer <token>'"
    name, why = tokens.caller(f"Bearer {TOKEN}x")
    assert name is None and "not one the server accepts" in why
    assert tokens.caller(f"Bearer {TOKEN[:-1]}")[0] is None


def test_a_changed_tokens_file_is_read_again_and_a_broken_one_keeps_the_old_tokens(
    tokens_file: Path,
) -> None:
    now = [0.0]
    tokens = TokenFile(tokens_file, reload_interval_s=5.0, clock=lambda: now[0])
    tokens_file.write_text(f"trainer:{SECRET}\n")  # rotated: the old token is gone
    now[0] = 4.9
    assert tokens.caller(f"Bearer {TOKEN}")[0] == Grant("trainer")  # not looked at again yet
    now[0] = 5.0
    assert tokens.caller(f"Bearer {TOKEN}")[0] is None
    assert tokens.caller(f"Bearer {SECRET}")[0] == Grant("trainer")
    tokens_file.write_text("not a token line\n")
    now[0] = 10.0
    assert tokens.caller(f"Bearer {SECRET}")[0] == Grant("trainer")  # kept; the log says why
    tokens_file.unlink()
    now[0] = 15.0
    assert tokens.caller(f"Bearer {SECRET}")[0] == Grant("trainer")


def test_a_tokens_file_that_could_not_be_read_is_read_again_once_its_mode_changes(
    tokens_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    now = [0.0]
    tokens = TokenFile(tokens_file, reload_interval_s=5.0, clock=lambda: now[0])
    tokens_file.write_text(f"trainer:{SECRET}\n")  # the old token revoked...
    real_read = Path.read_text

    def unreadable(path: Path, *args: Any, **kwargs: Any) -> str:
        if path == tokens_file:
            raise PermissionError(13, "Permission denied")
        return real_read(path, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", unreadable)  # ...but written with a wrong mode
    now[0] = 5.0
    assert tokens.caller(f"Bearer {TOKEN}")[0] == Grant("trainer")  # kept; the log says why
    monkeypatch.setattr(Path, "read_text", real_read)
    tokens_file.chmod(0o640)  # (the fix changes no byte of it)
    now[0] = 10.0
    assert tokens.caller(f"Bearer {TOKEN}")[0] is None
    assert tokens.caller(f"Bearer {SECRET}")[0] == Grant("trainer")


def test_a_tokens_line_grants_its_roles_calls_on_the_runs_it_names() -> None:
    text = (
        f"ops:{SECRET}\n"
        f"alice:{TOKEN} role=trainer runs=alice-*,shared-run\n"
        f"any-trainer:{TOKEN}-any role=trainer\n"
        f"engines:{ENGINE_TOKEN} role=engine\n"
        f"grafana:{ENGINE_TOKEN}-view role=viewer\n"
    )
    grants = {grant.name: grant for grant in parse_tokens(text, "tokens", ROLES).values()}
    ops, alice, any_trainer = grants["ops"], grants["alice"], grants["any-trainer"]
    engines, viewer = grants["engines"], grants["grafana"]
    assert ops == Grant("ops", "admin", None, ())  # a line that names no role: every call
    assert alice.runs == ("alice-*", "shared-run")
    for call in ("Submit", "Cancel", "PublishVersion", "DeleteRun"):
        assert alice.refuses(call, "alice-7") == ""
        assert alice.refuses(call, "shared-run") == ""
        assert any_trainer.refuses(call, "bob-1") == ""
        assert ops.refuses(call, "bob-1") == ""
        assert alice.refuses(call, "bob-1") == (
            "the token 'alice' may act on runs alice-*,shared-run only, not on 'bob-1'"
        )
        assert alice.refuses(call, "shared-run-2") != ""  # (a glob matches the whole id)
        assert engines.refuses(call, "alice-7").startswith(
            f"the token 'engines' (role engine) may not call {call}; it may call Heartbeat, "
            "RegisterEngine"
        )
        assert viewer.refuses(call, "alice-7") != ""
    assert alice.refuses("Status") == viewer.refuses("Status") == ""
    assert alice.refuses("RegisterEngine") != "" and engines.refuses("RegisterEngine") == ""
    assert engines.refuses("Status") != ""
    assert ops.refuses("RegisterEngine") == ops.refuses("SomethingNew") == ""
    # A byte-order mark (an editor's) is no part of the first name.
    assert [g.name for g in parse_tokens(f"\ufeffops:{SECRET}\n", "tokens").values()] == ["ops"]


def test_an_engine_token_may_be_limited_to_engine_ids() -> None:
    text = f"pool-a:{ENGINE_TOKEN} role=engine engines=pool-a-*,spare\n"
    (grant,) = parse_tokens(text, "tokens", ROLES).values()
    assert grant.engines == ("pool-a-*", "spare") and grant.scoped
    assert grant.refuses("RegisterEngine", engine_id="pool-a-3") == ""
    assert grant.refuses("Heartbeat", engine_id="spare") == ""
    assert grant.refuses("RegisterEngine", engine_id="pool-b-0") == (
        "the token 'pool-a' may act as engines pool-a-*,spare only, not as 'pool-b-0'"
    )


# ------------------------------------------------------------------ settings


def test_the_schedulers_credentials_settings_are_checked_at_start(
    tmp_path: Path, tokens_file: Path, pki: Pki
) -> None:
    def refused(**given: Any) -> str:
        with pytest.raises(ValidationError) as raised:
            SchedulerSettings(redis_url="redis://x", **given)
        return str(raised.value)

    assert "tls_cert_file and tls_key_file: give both" in refused(
        tls_cert_file=str(pki.server_cert)
    )
    assert "tls_client_ca_file needs tls_cert_file" in refused(tls_client_ca_file=str(pki.ca))
    missing = tmp_path / "missing"
    assert f"{missing}: cannot read the tokens file" in refused(auth_tokens_file=str(missing))
    mismatched = refused(tls_cert_file=str(pki.server_cert), tls_key_file=str(pki.client_key))
    assert f"the certificate {pki.server_cert} and the key {pki.client_key}" in mismatched
    encrypted = tmp_path / "encrypted-key.pem"
    encrypted.write_bytes(encrypt_key(pki.server_key, b"pass phrase"))
    said = refused(tls_cert_file=str(pki.server_cert), tls_key_file=str(encrypted))
    assert "the key is encrypted; give it unencrypted" in said
    assert "not PEM certificates" in refused(
        tls_cert_file=str(pki.server_cert),
        tls_key_file=str(pki.server_key),
        tls_client_ca_file=str(tokens_file),
    )
    fine = SchedulerSettings(
        redis_url="redis://x",
        tls_cert_file=str(pki.server_cert),
        tls_key_file=str(pki.server_key),
        tls_client_ca_file=str(pki.ca),
        auth_tokens_file=str(tokens_file),
    )
    tls = fine.server_tls()
    assert tls is not None and tls.client_ca_file == pki.ca
    # The engines' side: a CA to reach them over TLS, and the name their certificates carry.
    assert "engine_tls_server_name needs engine_ca_file" in refused(
        engine_tls_server_name="engines.internal"
    )
    assert f"engine_ca_file {missing}: cannot read it" in refused(engine_ca_file=str(missing))
    assert f"engine_ca_file {tokens_file}: not PEM certificates" in refused(
        engine_ca_file=str(tokens_file)
    )
    assert "at least 1 character" in refused(engine_ca_file=str(pki.ca), engine_tls_server_name="")
    # Mutual TLS to the engines: the certificate the scheduler shows them, with its key.
    assert "engine_cert_file and engine_key_file: give both" in refused(
        engine_ca_file=str(pki.ca), engine_cert_file=str(pki.client_cert)
    )
    assert "engine_cert_file needs engine_ca_file" in refused(
        engine_cert_file=str(pki.client_cert), engine_key_file=str(pki.client_key)
    )
    assert f"engine_cert_file {pki.client_cert} and engine_key_file {pki.server_key}" in refused(
        engine_ca_file=str(pki.ca),
        engine_cert_file=str(pki.client_cert),
        engine_key_file=str(pki.server_key),
    )
    assert "the key is encrypted; give it unencrypted" in refused(
        engine_ca_file=str(pki.ca),
        engine_cert_file=str(pki.server_cert),
        engine_key_file=str(encrypted),
    )
    with pytest.raises(ValueError, match="the dev stack's scheduler reaches its engines"):
        StackConfig(model=tmp_path, engine_args=("--tls-cert-file=/x",))
    with pytest.raises(ValidationError, match="tls_cert_file and tls_key_file: give both"):
        SimSettings(tls_cert_file=str(pki.server_cert))
    with pytest.raises(ValidationError, match="tls_client_ca_file needs tls_cert_file"):
        SimSettings(tls_client_ca_file=str(pki.ca))
    with pytest.raises(ValidationError, match="not PEM certificates"):
        SimSettings(
            tls_cert_file=str(pki.server_cert),
            tls_key_file=str(pki.server_key),
            tls_client_ca_file=str(tokens_file),
        )
    with pytest.raises(ValueError, match="the dev stack's scheduler reaches its engines"):
        StackConfig(model=tmp_path, engine_args=("--tls-client-ca-file=/x",))


def test_an_engines_scheduler_credentials_are_checked_at_start(tmp_path: Path, pki: Pki) -> None:
    # (vLLM's engines and the simulated ones take the same settings of their link)
    assert issubclass(EngineSettings, SchedulerLink) and issubclass(SimSettings, SchedulerLink)
    settings = SimSettings
    token = tmp_path / "token"
    token.write_text(f"{ENGINE_TOKEN}\n")
    with pytest.raises(ValidationError, match="scheduler_token_file: for a scheduler"):
        settings(scheduler_token_file=str(token))
    with pytest.raises(ValidationError, match=r"token_file .*\(it is empty\)"):
        (tmp_path / "empty").write_text("\n")
        settings(scheduler_address="localhost:1", scheduler_token_file=str(tmp_path / "empty"))
    with pytest.raises(ValidationError, match="scheduler_key_file: for a scheduler"):
        settings(scheduler_key_file=str(pki.client_key))
    with pytest.raises(ValidationError, match=r"token_file .*: it must hold the token alone"):
        (tmp_path / "two-lines").write_text(f"engines:{ENGINE_TOKEN}\nmore\n")
        settings(scheduler_address="localhost:1", scheduler_token_file=str(tmp_path / "two-lines"))
    with pytest.raises(ValidationError, match="cert_pem and key_pem: give both"):
        settings(scheduler_address="localhost:1", scheduler_cert_file=str(pki.client_cert))
    made = settings(
        scheduler_address="localhost:1",
        scheduler_token_file=str(token),
        scheduler_ca_file=str(pki.ca),
    )
    # (a bare --scheduler-tls, as the engine's flag takes it)
    assert sim_parse_settings(["--scheduler-address", "h:1", "--scheduler-tls"], True).scheduler_tls
    credentials = made.scheduler_credentials()
    assert credentials.secure and credentials.metadata == (
        ("authorization", f"Bearer {ENGINE_TOKEN}"),
    )
    assert ENGINE_TOKEN not in repr(credentials)


def test_the_sdks_credentials_refuse_what_no_scheduler_could_take(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="token: must be visible ASCII"):
        SchedulerCredentials(token=f"Bearer {TOKEN}")
    with pytest.raises(ValueError, match="server_name: only for TLS"):
        SchedulerCredentials(server_name="localhost")
    with pytest.raises(ValueError, match=r"ca_file .*missing: cannot read it"):
        SchedulerCredentials.from_files(ca_file=tmp_path / "missing")


# ------------------------------------------------------------------ over the wire


async def test_a_scheduler_with_tokens_refuses_calls_without_one_and_takes_those_with_one(
    redis_url: str, tokens_file: Path
) -> None:
    async with scheduler(redis_url, auth_tokens_file=str(tokens_file)) as (served, http_port):
        for credentials in (SchedulerCredentials(), SchedulerCredentials(token=SECRET)):
            async with client(redis_url, served.port, credentials) as anonymous:
                with pytest.raises(Unauthenticated) as raised:
                    await anonymous.submit([group("g0")])
                assert raised.value.code == grpc.StatusCode.UNAUTHENTICATED
                with pytest.raises(Unauthenticated):
                    await anonymous.status()
        async with client(redis_url, served.port, SchedulerCredentials(token=TOKEN)) as trainer:
            assert await trainer.submit([group("g0")]) == 1
            assert (await trainer.status()).queue_depth >= 1
            assert (await trainer.cancel(["g0"])).cancelled == ("g0",)
            await trainer.delete_run()  # (nothing left for the next tests' schedulers)

        # Health checks need no token (orchestrators probe without one).
        async with grpc.aio.insecure_channel(f"localhost:{served.port}") as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=10
            )
            assert reply.status == health_pb2.HealthCheckResponse.SERVING

        # The sync client says the same.
        def sync_calls() -> None:
            with (
                RolloutClient(f"localhost:{served.port}", redis_url, "sync-run") as anonymous,
                pytest.raises(Unauthenticated, match="no credentials"),
            ):
                anonymous.status()
            credentials = SchedulerCredentials(token=TOKEN)
            with RolloutClient(
                f"localhost:{served.port}", redis_url, "sync-run", credentials=credentials
            ) as trainer:
                trainer.status()

        await asyncio.to_thread(sync_calls)

        # HTTP: 401 with a challenge, but for the probes' and tools' paths.
        async with aiohttp.ClientSession() as http:
            url = f"http://127.0.0.1:{http_port}"
            async with http.get(f"{url}/v1/status") as reply:
                assert reply.status == 401
                assert reply.headers["WWW-Authenticate"] == 'Bearer realm="rollserve"'
                error = (await reply.json())["error"]
                assert error["status"] == "UNAUTHENTICATED"
                assert error["message"].startswith("no credentials")
            wrong = {"Authorization": f"Bearer {SECRET}"}
            async with http.delete(f"{url}/v1/runs/some-run", headers=wrong) as reply:
                assert reply.status == 401
                assert 'error="invalid_token"' in reply.headers["WWW-Authenticate"]
            right = {"Authorization": f"Bearer {TOKEN}"}
            async with http.get(f"{url}/v1/status", headers=right) as reply:
                assert reply.status == 200
            for path in ("/healthz", "/metrics", "/openapi.json"):
                async with http.get(f"{url}{path}") as reply:
                    assert reply.status == 200, path


async def test_an_engine_registers_with_a_token_of_the_file_and_reads_its_own_again(
    redis_url: str, tokens_file: Path, tmp_path: Path
) -> None:
    async with scheduler(redis_url, auth_tokens_file=str(tokens_file)) as (served, _):
        address = f"localhost:{served.port}"
        async with grpc.aio.insecure_channel(address) as channel:
            stub = pb_grpc.SchedulerStub(channel)
            request = pb.RegisterEngineRequest(engine_id="intruder", address="127.0.0.1:9")
            for metadata in ((), (("authorization", f"Bearer {SECRET}"),)):
                with pytest.raises(grpc.aio.AioRpcError) as raised:
                    await stub.RegisterEngine(request, timeout=10, metadata=metadata)
                assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED

            # The engine's token file holds a token the scheduler does not take, then the
            # right one (a rotation reached the engine's Secret later than the scheduler's):
            # the engine registers at its next attempt, without a restart.
            token_file = tmp_path / "engine-token"
            token_file.write_text(f"{SECRET}\n")
            link_settings = SchedulerLink(
                scheduler_address=address, scheduler_token_file=str(token_file)
            )
            link = asyncio.create_task(
                stay_registered(
                    address, "sim-0", "127.0.0.1:9", link_settings.scheduler_credentials
                )
            )
            shown = SchedulerCredentials(token=ENGINE_TOKEN).metadata

            async def engines() -> list[str]:
                status = await stub.Status(pb.StatusRequest(), timeout=10, metadata=shown)
                return [e.engine_id for e in status.engines]

            try:
                await asyncio.sleep(0.3)  # (its first attempt was refused)
                assert await engines() == []
                token_file.write_text(f"{ENGINE_TOKEN}\n")
                for _ in range(200):
                    if await engines():
                        break
                    await asyncio.sleep(0.05)
                assert await engines() == ["sim-0"]
            finally:
                link.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await link


async def test_a_token_is_refused_the_calls_and_runs_its_grant_does_not_cover(
    redis_url: str, tmp_path: Path
) -> None:
    tokens_file = tmp_path / "tokens"
    tokens_file.write_text(
        f"alice:{TOKEN} role=trainer runs=alice-*\n"
        f"engines:{ENGINE_TOKEN} role=engine engines=e-*\n"
        f"grafana:{SECRET} role=viewer\n"
    )
    alice = SchedulerCredentials(token=TOKEN)
    async with scheduler(redis_url, auth_tokens_file=str(tokens_file)) as (served, http_port):
        address = f"localhost:{served.port}"
        own = f"alice-{uuid.uuid4().hex[:8]}"
        async with AsyncRolloutClient(address, redis_url, own, credentials=alice) as trainer:
            assert await trainer.submit([group("g0")]) == 1
            assert (await trainer.cancel(["g0"])).cancelled == ("g0",)
            await trainer.status()
            await trainer.delete_run()
        async with AsyncRolloutClient(address, redis_url, "bob-1", credentials=alice) as other:
            with pytest.raises(PermissionDenied) as raised:
                await other.submit([group("g0")])
            assert raised.value.code == grpc.StatusCode.PERMISSION_DENIED
            assert "may act on runs alice-* only, not on 'bob-1'" in str(raised.value)
            with pytest.raises(PermissionDenied):
                await other.delete_run()
            with pytest.raises(PermissionDenied):
                await other.publish_version(1)

        async with grpc.aio.insecure_channel(address) as channel:
            stub = pb_grpc.SchedulerStub(channel)
            register = pb.RegisterEngineRequest(engine_id="e-0", address="127.0.0.1:9")
            for token in (TOKEN, SECRET):  # a trainer's and a viewer's
                with pytest.raises(grpc.aio.AioRpcError) as error:
                    await stub.RegisterEngine(
                        register, timeout=10, metadata=(("authorization", f"Bearer {token}"),)
                    )
                assert error.value.code() == grpc.StatusCode.PERMISSION_DENIED
                assert "may not call RegisterEngine" in (error.value.details() or "")
            engine = (("authorization", f"Bearer {ENGINE_TOKEN}"),)
            await stub.RegisterEngine(register, timeout=10, metadata=engine)
            # engines=e-*: another id is refused, at registration and heartbeat alike.
            foreign = pb.RegisterEngineRequest(engine_id="x-0", address="127.0.0.1:9")
            for attempt in (
                stub.RegisterEngine(foreign, timeout=10, metadata=engine),
                stub.Heartbeat(pb.HeartbeatRequest(engine_id="x-0"), timeout=10, metadata=engine),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as error:
                    await attempt
                assert error.value.code() == grpc.StatusCode.PERMISSION_DENIED
                assert "may act as engines e-* only, not as 'x-0'" in (error.value.details() or "")
            await stub.Heartbeat(pb.HeartbeatRequest(engine_id="e-0"), timeout=10, metadata=engine)
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await stub.Status(pb.StatusRequest(), timeout=10, metadata=engine)
            assert error.value.code() == grpc.StatusCode.PERMISSION_DENIED
            submit = pb.SubmitRequest(run_id="alice-1", groups=[group("g0").to_proto()])
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await stub.Submit(submit, timeout=10, metadata=engine)
            assert error.value.code() == grpc.StatusCode.PERMISSION_DENIED

        console = Console(record=True, width=200)
        for token, expected in ((SECRET, 0), (ENGINE_TOKEN, UNREACHABLE_EXIT_CODE)):
            code = await asyncio.to_thread(
                run_status, address, 10.0, True, console, SchedulerCredentials(token=token)
            )
            assert code == expected
        assert "refused the call: PERMISSION_DENIED: the token 'engines'" in console.export_text()

        async with aiohttp.ClientSession() as http:
            url = f"http://127.0.0.1:{http_port}"
            as_alice = {"Authorization": f"Bearer {TOKEN}"}
            as_viewer = {"Authorization": f"Bearer {SECRET}"}
            as_engine = {"Authorization": f"Bearer {ENGINE_TOKEN}"}
            async with http.delete(f"{url}/v1/runs/bob-1", headers=as_alice) as reply:
                assert reply.status == 403
                error = (await reply.json())["error"]
                assert error["status"] == "PERMISSION_DENIED"
                assert "not on 'bob-1'" in error["message"]
            async with http.delete(f"{url}/v1/runs/alice-x%2A", headers=as_viewer) as reply:
                assert reply.status == 403
            for method in ("GET", "HEAD"):  # (aiohttp answers HEAD with the GET route)
                async with http.request(method, f"{url}/v1/status", headers=as_engine) as reply:
                    assert reply.status == 403, method
                async with http.request(method, f"{url}/v1/status", headers=as_viewer) as reply:
                    assert reply.status == 200, method
            async with http.get(f"{url}/v1/nothing-here", headers=as_engine) as reply:
                assert reply.status == 404  # (no call: the token is enough to be told so)
            async with http.get(f"{url}/metrics") as reply:
                assert reply.status == 200
            body = {"groups": [json_format.MessageToDict(group("g1").to_proto())]}
            path = f"{url}/v1/runs/alice-http-{uuid.uuid4().hex[:6]}"
            async with http.post(f"{path}/groups", json=body, headers=as_alice) as reply:
                assert reply.status == 200, await reply.text()
            async with http.delete(path, headers=as_alice) as reply:
                assert reply.status == 200


async def test_status_shows_a_token_limited_to_runs_only_those_runs(
    redis_url: str, tmp_path: Path
) -> None:
    tokens_file = tmp_path / "tokens"
    tokens_file.write_text(
        f"ops:{SECRET}\n"
        f"alice:{TOKEN} role=trainer runs=alice-*\n"
        f"grafana:{ENGINE_TOKEN} role=viewer\n"
    )
    suffix = uuid.uuid4().hex[:8]
    runs = {f"alice-{suffix}": TOKEN, f"bob-{suffix}": SECRET}
    async with scheduler(redis_url, auth_tokens_file=str(tokens_file)) as (served, http_port):
        address = f"localhost:{served.port}"
        clients = {
            run: AsyncRolloutClient(
                address, redis_url, run, credentials=SchedulerCredentials(token=token)
            )
            for run, token in runs.items()
        }
        try:
            for run_client in clients.values():  # (queued: the scheduler has no engine)
                assert await run_client.submit([group("g0")]) == 1

            async def shown(token: str) -> set[str]:
                credentials = SchedulerCredentials(token=token)
                async with AsyncRolloutClient(
                    address, redis_url, "any", credentials=credentials
                ) as caller:
                    status = await caller.status()
                async with (
                    aiohttp.ClientSession() as http,
                    http.get(
                        f"http://127.0.0.1:{http_port}/v1/status",
                        headers={"Authorization": f"Bearer {token}"},
                    ) as reply,
                ):
                    over_http = {run["run_id"] for run in (await reply.json())["runs"]}
                over_grpc = {run.run_id for run in status.runs}
                assert over_grpc == over_http
                assert status.queue_depth >= 2  # (the queue's totals stay whole)
                return over_grpc & set(runs)

            assert await shown(SECRET) == set(runs)  # admin
            assert await shown(ENGINE_TOKEN) == set(runs)  # a viewer limited to no run
            assert await shown(TOKEN) == {f"alice-{suffix}"}
        finally:
            for run_client in clients.values():
                await run_client.delete_run()
                await run_client.close()


async def test_a_call_that_gives_its_authorization_twice_is_refused(
    redis_url: str, tokens_file: Path
) -> None:
    async with scheduler(redis_url, auth_tokens_file=str(tokens_file)) as (served, http_port):
        good, bad = f"Bearer {TOKEN}", f"Bearer {SECRET}"
        async with grpc.aio.insecure_channel(f"localhost:{served.port}") as channel:
            stub = pb_grpc.SchedulerStub(channel)
            await stub.Status(pb.StatusRequest(), timeout=10, metadata=(("authorization", good),))
            for pair in ((good, bad), (bad, good), (good, good)):
                metadata = tuple(("authorization", value) for value in pair)
                with pytest.raises(grpc.aio.AioRpcError) as raised:
                    await stub.Status(pb.StatusRequest(), timeout=10, metadata=metadata)
                assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert "more than once" in (raised.value.details() or "")
        async with aiohttp.ClientSession() as http:
            url = f"http://127.0.0.1:{http_port}/v1/status"
            for pair in ((good, bad), (bad, good)):
                headers = [("Authorization", value) for value in pair]
                async with http.get(url, headers=headers) as reply:
                    assert reply.status == 401
                    assert "more than once" in (await reply.json())["error"]["message"]


async def test_a_tls_scheduler_takes_callers_that_trust_its_ca_over_grpc_and_https(
    redis_url: str, tokens_file: Path, pki: Pki
) -> None:
    tls = {"tls_cert_file": str(pki.server_cert), "tls_key_file": str(pki.server_key)}
    async with scheduler(redis_url, auth_tokens_file=str(tokens_file), **tls) as (
        served,
        http_port,
    ):
        trusted = SchedulerCredentials.from_files(ca_file=pki.ca)
        trusted = SchedulerCredentials(token=TOKEN, ca_pem=trusted.ca_pem)
        async with client(redis_url, served.port, trusted) as trainer:
            assert await trainer.submit([group("g0")]) == 1
            await trainer.delete_run()
        # Plaintext reaches no TLS server, nor does a client that trusts another CA.
        for credentials in (
            SchedulerCredentials(token=TOKEN),
            SchedulerCredentials.from_files(ca_file=pki.other_ca),
        ):
            async with client(redis_url, served.port, credentials) as stranger:
                with pytest.raises(SchedulerUnavailable):
                    await stranger.status()

        context = ssl.create_default_context(cafile=str(pki.ca))
        async with aiohttp.ClientSession() as http:
            url = f"https://localhost:{http_port}"
            right = {"Authorization": f"Bearer {TOKEN}"}
            async with http.get(f"{url}/v1/status", headers=right, ssl=context) as reply:
                assert reply.status == 200
            async with http.get(f"{url}/healthz", ssl=context) as reply:
                assert reply.status == 200
            with pytest.raises(aiohttp.ClientError):
                async with http.get(f"http://localhost:{http_port}/healthz"):
                    pass

        # rollserve status, as a script would call it (in a thread: it blocks).
        console = Console(record=True, width=200)
        code = await asyncio.to_thread(
            run_status, f"localhost:{served.port}", 10.0, True, console, trusted
        )
        assert code == 0
        code = await asyncio.to_thread(
            run_status,
            f"localhost:{served.port}",
            10.0,
            True,
            console,
            SchedulerCredentials(ca_pem=trusted.ca_pem),
        )
        assert code == UNREACHABLE_EXIT_CODE
        assert "refused the call: UNAUTHENTICATED" in console.export_text()


async def test_a_mutual_tls_scheduler_wants_a_certificate_its_client_ca_signed(
    redis_url: str, pki: Pki
) -> None:
    tls = {
        "tls_cert_file": str(pki.server_cert),
        "tls_key_file": str(pki.server_key),
        "tls_client_ca_file": str(pki.ca),
    }
    async with scheduler(redis_url, **tls) as (served, http_port):
        without = SchedulerCredentials.from_files(ca_file=pki.ca)
        async with client(redis_url, served.port, without) as stranger:
            with pytest.raises(SchedulerUnavailable):
                await stranger.status()
        mutual = SchedulerCredentials.from_files(
            ca_file=pki.ca, cert_file=pki.client_cert, key_file=pki.client_key
        )
        async with client(redis_url, served.port, mutual) as trainer:
            await trainer.status()

        context = ssl.create_default_context(cafile=str(pki.ca))
        async with aiohttp.ClientSession() as http:
            with pytest.raises(aiohttp.ClientError):
                async with http.get(f"https://localhost:{http_port}/v1/status", ssl=context):
                    pass
            context.load_cert_chain(pki.client_cert, pki.client_key)
            async with http.get(f"https://localhost:{http_port}/v1/status", ssl=context) as reply:
                assert reply.status == 200
            # TLS 1.3 without session tickets: nothing resumes a session made under a client
            # CA since taken out (a resumption skips the certificate check), and TLS 1.2,
            # whose session cache would, is refused.
        context.maximum_version = ssl.TLSVersion.TLSv1_2
        async with aiohttp.ClientSession() as http:  # (a new connection)
            with pytest.raises(aiohttp.ClientError):
                async with http.get(f"https://localhost:{http_port}/v1/status", ssl=context):
                    pass
        server_context = ServerTls.load(pki.server_cert, pki.server_key, pki.ca)._context()
        assert server_context.minimum_version == ssl.TLSVersion.TLSv1_3
        assert server_context.num_tickets == 0


async def test_a_renewed_certificate_is_served_to_new_connections_without_a_restart(
    tmp_path: Path,
) -> None:
    """gRPC and HTTPS servers of one ``ServerTls`` (as the scheduler serves them) take the
    certificate that replaced theirs, and keep theirs while the files make no valid set."""
    for folder in ("a", "b", "live"):
        (tmp_path / folder).mkdir()
    first, second = make_pki(tmp_path / "a"), make_pki(tmp_path / "b")  # (two CAs)
    live = tmp_path / "live"
    cert, key = live / "server.pem", live / "server-key.pem"

    def install(pki: Pki) -> None:  # (as a Secret's update: new files swapped in)
        for source, target in ((pki.server_cert, cert), (pki.server_key, key)):
            staged = target.with_suffix(".new")
            staged.write_bytes(source.read_bytes())
            staged.replace(target)

    install(first)
    tls = ServerTls.load(cert, key, reload_interval_s=0.05)
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health_aio.HealthServicer(), server)
    grpc_port = server.add_secure_port("127.0.0.1:0", tls.grpc_credentials())
    await server.start()
    app = web.Application()

    async def hello(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app.router.add_get("/", hello)
    runner = web.AppRunner(app)
    await runner.setup()
    http_port = free_port()
    await web.TCPSite(runner, "127.0.0.1", http_port, ssl_context=tls.ssl_context()).start()

    async def trusted_by(pki: Pki) -> tuple[bool, bool]:
        """Whether a new connection to each server (gRPC, HTTPS) trusts what it shows."""
        credentials = grpc.ssl_channel_credentials(root_certificates=pki.ca.read_bytes())
        async with grpc.aio.secure_channel(f"127.0.0.1:{grpc_port}", credentials) as channel:
            try:
                await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=5
                )
                over_grpc = True
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAVAILABLE
                over_grpc = False
        context = ssl.create_default_context(cafile=pki.ca)
        async with aiohttp.ClientSession() as http:
            try:
                async with http.get(f"https://127.0.0.1:{http_port}/", ssl=context) as reply:
                    over_https = reply.status == 200
            except aiohttp.ClientConnectorCertificateError:
                over_https = False
        return over_grpc, over_https

    try:
        assert await trusted_by(first) == (True, True)
        assert await trusted_by(second) == (False, False)
        install(second)
        await asyncio.sleep(0.1)
        assert await trusted_by(second) == (True, True)
        assert await trusted_by(first) == (False, False)
        # A key that is not the certificate's (a renewal half written): the last set stays.
        key.write_bytes(first.server_key.read_bytes())
        await asyncio.sleep(0.1)
        assert await trusted_by(second) == (True, True)
        install(first)
        await asyncio.sleep(0.1)
        assert await trusted_by(first) == (True, True)
    finally:
        await server.stop(None)
        await runner.cleanup()


def test_an_engines_tokens_file_takes_plain_tokens_and_a_schedulers_token_file_one(
    tmp_path: Path,
) -> None:
    api_tokens = tmp_path / "engine-api-tokens"
    for line, said in (
        (f"scheduler:{TOKEN} runs=a-*", "runs= narrow a token to the scheduler's runs"),
        (f"scheduler:{TOKEN} engines=e-*", "engines= narrow a token"),
        (f"scheduler:{TOKEN} role=trainer", "role 'trainer' is not one of admin"),
    ):
        api_tokens.write_text(line + "\n")
        with pytest.raises(ValidationError, match=said):
            SimSettings(auth_tokens_file=str(api_tokens))
    api_tokens.write_text(f"scheduler:{TOKEN}\n")
    assert SimSettings(auth_tokens_file=str(api_tokens)).api_tokens() is not None
    token_file = tmp_path / "engine-token"
    token_file.write_text(f"\ufeff{TOKEN}\n")  # (an editor's byte-order mark)
    settings = SchedulerSettings(redis_url="redis://x:1", engine_token_file=str(token_file))
    bearer = settings.engine_token()
    assert bearer is not None and bearer.metadata() == (("authorization", f"Bearer {TOKEN}"),)
    token_file.write_text("two tokens-0123456789abcdef\n")
    with pytest.raises(ValidationError, match="must hold one token alone"):
        SchedulerSettings(redis_url="redis://x:1", engine_token_file=str(token_file))


async def test_engines_with_tokens_take_the_schedulers_calls_and_refuse_others(
    redis_url: str, tmp_path: Path
) -> None:
    """A sim engine started with ``--auth-tokens-file``: the scheduler's calls carry the
    token of its ``--engine-token-file`` (read again when it changes) and run; anyone else's
    are refused, health checks excepted."""
    api_tokens = tmp_path / "engine-api-tokens"
    api_tokens.write_text(f"scheduler:{TOKEN}\n")
    token_file = tmp_path / "engine-token"
    token_file.write_text(f"{TOKEN}\n")
    settings = SimSettings(engine_id="locked", time_scale=0.05, auth_tokens_file=str(api_tokens))
    async with sim_engine(settings) as address:
        async with grpc.aio.insecure_channel(address) as channel:
            health = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=10
            )
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            engine = pb_grpc.EngineStub(channel)
            for metadata in ((), (("authorization", f"Bearer {SECRET}"),)):
                with pytest.raises(grpc.aio.AioRpcError) as raised:
                    await engine.Stats(pb.StatsRequest(), timeout=10, metadata=metadata)
                assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED
                calls = engine.Generate(pb.GenerateRequest(request_id="x", n=1), metadata=metadata)
                with pytest.raises(grpc.aio.AioRpcError) as raised:
                    async for _ in calls:
                        pass
                assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED

        endpoint = EngineEndpoint(engine_id="locked", address=address)
        async with (
            scheduler(redis_url, engines=(endpoint,), engine_token_file=str(token_file)) as (
                served,
                _,
            ),
            client(redis_url, served.port) as trainer,
        ):
            for round_ in range(2):
                await delivered(trainer, f"g{round_}")
                if round_ == 0:
                    # The engines' token rotates, no restart: the new one added to the
                    # engines' file, the scheduler moved to it, the old one taken out (each
                    # file read again within the interval).
                    api_tokens.write_text(f"scheduler:{TOKEN}\nnext:{ENGINE_TOKEN}\n")
                    token_file.write_text(f"{ENGINE_TOKEN}\n")
                    await asyncio.sleep(RELOAD_INTERVAL_S + 0.5)
                    api_tokens.write_text(f"next:{ENGINE_TOKEN}\n")
                    await asyncio.sleep(RELOAD_INTERVAL_S + 0.5)
            await trainer.delete_run()


async def test_engines_serving_tls_are_reached_with_the_ca_that_signed_them(
    redis_url: str, pki: Pki
) -> None:
    settings = SimSettings(
        engine_id="sealed",
        time_scale=0.05,
        tls_cert_file=str(pki.server_cert),
        tls_key_file=str(pki.server_key),
    )
    async with sim_engine(settings) as address:
        async with grpc.aio.insecure_channel(address) as channel:  # (plaintext: no answer)
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await pb_grpc.EngineStub(channel).Stats(pb.StatsRequest(), timeout=5)
            assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
        endpoint = EngineEndpoint(engine_id="sealed", address=address)
        async with (
            scheduler(redis_url, engines=(endpoint,), engine_ca_file=str(pki.other_ca)) as (
                served,
                _,
            ),
            client(redis_url, served.port) as stranger,
        ):
            await asyncio.sleep(1.0)  # (probes fail: the certificate is another CA's)
            [engine] = (await stranger.status()).engines
            assert not engine.healthy and engine.last_error
        async with (
            scheduler(redis_url, engines=(endpoint,), engine_ca_file=str(pki.ca)) as (served, _),
            client(redis_url, served.port) as trainer,
        ):
            await delivered(trainer, "g0")
            await trainer.delete_run()


async def test_engines_asking_for_mutual_tls_take_the_certificate_the_scheduler_shows(
    redis_url: str, tmp_path: Path, pki: Pki
) -> None:
    """A sim engine started with ``--tls-client-ca-file``: a caller that shows no
    certificate, or one another CA signed, cannot reach it. The scheduler's CA and
    certificate files rewritten (renewed, say), it reaches the engine within the reload
    interval, with no restart."""
    (tmp_path / "second").mkdir()
    stranger = make_pki(tmp_path / "second")  # (its client certificate: another CA's)
    ca, cert, key = (tmp_path / name for name in ("e-ca.pem", "e-cert.pem", "e-key.pem"))
    ca.write_bytes(pki.other_ca.read_bytes())
    cert.write_bytes(stranger.client_cert.read_bytes())
    key.write_bytes(stranger.client_key.read_bytes())
    settings = SimSettings(
        engine_id="mutual",
        time_scale=0.05,
        tls_cert_file=str(pki.server_cert),
        tls_key_file=str(pki.server_key),
        tls_client_ca_file=str(pki.ca),
    )
    async with sim_engine(settings) as address:
        no_certificate = grpc.ssl_channel_credentials(root_certificates=pki.ca.read_bytes())
        async with grpc.aio.secure_channel(address, no_certificate) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await pb_grpc.EngineStub(channel).Stats(pb.StatsRequest(), timeout=5)
            assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
        endpoint = EngineEndpoint(engine_id="mutual", address=address)
        files = {
            "engine_ca_file": str(ca),
            "engine_cert_file": str(cert),
            "engine_key_file": str(key),
        }
        async with (
            scheduler(redis_url, engines=(endpoint,), **files) as (served, _),
            client(redis_url, served.port) as trainer,
        ):

            async def healthy_within(seconds: float) -> bool:
                for _ in range(int(seconds / 0.25)):
                    [engine] = (await trainer.status()).engines
                    if engine.healthy:
                        return True
                    await asyncio.sleep(0.25)
                return False

            assert not await healthy_within(1.0)  # (neither side trusts the other)
            ca.write_bytes(pki.ca.read_bytes())
            assert not await healthy_within(RELOAD_INTERVAL_S + 2.0)  # (the engine still not)
            cert.write_bytes(pki.client_cert.read_bytes())
            key.write_bytes(pki.client_key.read_bytes())
            assert await healthy_within(RELOAD_INTERVAL_S + 10.0)
            await delivered(trainer, "g0")
            await trainer.delete_run()


async def test_a_call_in_flight_ends_on_its_connection_when_engine_credentials_change(
    tmp_path: Path, pki: Pki
) -> None:
    """New credentials open a new connection to the engine for the calls made from then on;
    a stream already running on the old one runs to its end, and the old connection is
    closed after it: the health watch on it ends then (to be opened again on the new one).
    A closed handle opens no connection."""
    settings = SimSettings(
        engine_id="renewed",
        time_scale=1.0,
        tls_cert_file=str(pki.server_cert),
        tls_key_file=str(pki.server_key),
    )
    ca = tmp_path / "engine-ca.pem"
    ca.write_bytes(pki.ca.read_bytes())
    tls = EngineTls(ClientTls(ca, reload_interval_s=0.0))
    async with sim_engine(settings) as address:
        handle = EngineHandle("renewed", address, 1.0, tls=tls)
        try:
            await handle.probe(TIMEOUT_S)
            statuses = handle.watch()
            assert await asyncio.wait_for(anext(statuses), TIMEOUT_S) is True

            async def follow() -> None:
                async for _ in statuses:
                    pass

            watching = asyncio.create_task(follow())
            call = handle.generate(spec(max_tokens=400), "call-0", [0, 1])
            replies = aiter(call)
            await asyncio.wait_for(anext(replies), TIMEOUT_S)
            ca.write_bytes(pki.ca.read_bytes() + b"\n")  # (renewed: the same CA, new bytes)
            await handle.stats(TIMEOUT_S)  # (on a new connection)
            assert tls.client.generation == 1
            assert not call.done() and not watching.done()
            async for _ in replies:
                pass
            assert await call.code() == grpc.StatusCode.OK
            await asyncio.wait_for(watching, TIMEOUT_S)  # (ended, not cancelled)
            assert await handle.probe(TIMEOUT_S) is False
        finally:
            await handle.close()
        ca.write_bytes(pki.ca.read_bytes())  # (a change after the close)
        with pytest.raises(grpc.aio.UsageError, match="closed"):
            await handle.stats(TIMEOUT_S)


async def test_an_engine_says_its_health_in_plaintext_http_for_probes(tmp_path: Path) -> None:
    """An engine whose gRPC port serves TLS cannot be probed by the kubelet's gRPC probe:
    its metrics port answers ``GET /healthz`` from the same health status."""
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    settings = EngineSettings(model=tmp_path, host="127.0.0.1", metrics_port=free_port())
    servicer = AioHealthServicer()
    await set_health(servicer, health_pb2.HealthCheckResponse.NOT_SERVING)  # (as it loads)
    metrics = await serve_metrics(settings, servicer)
    assert metrics is not None
    url = f"http://127.0.0.1:{settings.metrics_port}/healthz"
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(url) as reply:
                assert (reply.status, await reply.json()) == (503, {"status": "NOT_SERVING"})
            await set_health(servicer, health_pb2.HealthCheckResponse.SERVING)
            async with http.get(url) as reply:
                assert (reply.status, await reply.json()) == (200, {"status": "SERVING"})
            await servicer.enter_graceful_shutdown()
            async with http.get(url) as reply:
                assert reply.status == 503
    finally:
        await metrics.stop()
