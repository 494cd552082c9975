"""Who may call a service: TLS on its servers, bearer tokens on its calls.

**Tokens.** A tokens file holds one token a line, as ``NAME:TOKEN [role=ROLE]
[runs=GLOB,...] [engines=GLOB,...]``; blank lines and lines that start with ``#`` are
skipped. NAME (letters, digits, ``_.-``, 64 at most) says whose the token is in the
service's log; TOKEN is 16 to 4096 visible ASCII characters (``openssl rand -hex 32`` makes
one). A call carries its token as ``authorization: Bearer TOKEN`` (gRPC metadata, or the
HTTP header). The file is read again within ``reload_interval_s`` of a change (a Kubernetes
Secret updated in place), so tokens rotate without a restart: add the new one, move the
callers to it, remove the old. A file that no longer parses keeps the tokens read before,
and says why in the log.

**Rights.** What a token may do is its grant (``Grant``). Its role, one of the service's
(``Role``; the service's default role where the line names none), says which calls it may
make. ``runs=`` narrows it to runs whose id matches one of the globs (``*`` any characters,
``?`` one): a call whose request names a ``run_id`` must name one of them; ``engines=`` so
to engines, by the ``engine_id`` a request names (an engine's registration). A call its
token does not cover is refused with PERMISSION_DENIED (HTTP 403), naming the token and what
it lacks; a call without an accepted token with UNAUTHENTICATED (HTTP 401).

**TLS.** A server certificate and its key (PEM); with a client CA, callers must show a
certificate it signed (mutual TLS). The files are read again within ``reload_interval_s``
of a change, at a new connection: certificates rotate without a restart.

Health checks stay open (orchestrators probe without credentials), as does gRPC reflection
(the schema, nothing of the state); the HTTP server's open paths are its owner's choice.
"""

from __future__ import annotations

import contextvars
import fnmatch
import hmac
import inspect
import logging
import os
import re
import ssl
import threading
import time
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import grpc
from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

__all__ = [
    "ADMIN",
    "CALLER",
    "OPEN_GRPC_PREFIXES",
    "BearerFile",
    "ClientTls",
    "Grant",
    "GrpcTokenCheck",
    "Role",
    "ServerTls",
    "TokenFile",
    "http_token_check",
    "parse_tokens",
]

log = logging.getLogger(__name__)

MIN_TOKEN_CHARS = 16
MAX_TOKEN_CHARS = 4096
RELOAD_INTERVAL_S = 5.0  # how soon a changed tokens file is read again, at most
REFUSAL_LOG_INTERVAL_S = 10.0  # one log line at most this often for refused calls
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_TOKEN = re.compile(rf"[\x21-\x7e]{{{MIN_TOKEN_CHARS},{MAX_TOKEN_CHARS}}}")
_GLOB = re.compile(r"[A-Za-z0-9_.*?-]{1,256}")  # (a run id's alphabet, and * ?)

_TWICE = "the authorization is given more than once: give one"
_NAME_SHOWN_CHARS = 80  # of a name that is not one, in the error

OPEN_GRPC_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
"""gRPC methods called without a token: health checks and reflection."""


@dataclass(frozen=True)
class Role:
    """The calls a token of this role may make, by name (the service's gRPC methods' names,
    such as ``Submit``); None: every call."""

    calls: frozenset[str] | None = None


ADMIN = "admin"
"""The role of a token whose line names none, unless the service says otherwise."""
_ALL = {ADMIN: Role()}


@dataclass(frozen=True)
class Grant:
    """What the token of ``name`` may do: the calls of its role (None: all), on the runs
    whose id matches one of ``runs``' globs and as the engines whose id matches one of
    ``engines``' (none given: every run, every engine)."""

    name: str
    role: str = ADMIN
    calls: frozenset[str] | None = None
    runs: tuple[str, ...] = ()
    engines: tuple[str, ...] = ()

    @property
    def scoped(self) -> bool:
        """Whether it is limited to some runs or engines."""
        return bool(self.runs or self.engines)

    def refuses(self, call: str, run_id: str | None = None, engine_id: str | None = None) -> str:
        """Why the grant does not cover ``call`` on run ``run_id`` as engine ``engine_id``
        (None: a call that names none); "" when it does."""
        if self.calls is not None and call not in self.calls:
            return (
                f"the token {self.name!r} (role {self.role}) may not call {call}; it may call "
                f"{', '.join(sorted(self.calls)) or 'nothing'}"
            )
        if run_id is not None and not self.covers(run_id):
            return (
                f"the token {self.name!r} may act on runs {','.join(self.runs)} only, not on "
                f"{run_id[:_NAME_SHOWN_CHARS]!r}"
            )
        if engine_id is not None and not _matches(engine_id, self.engines):
            return (
                f"the token {self.name!r} may act as engines {','.join(self.engines)} only, "
                f"not as {engine_id[:_NAME_SHOWN_CHARS]!r}"
            )
        return ""

    def covers(self, run_id: str) -> bool:
        """Whether the grant reaches run ``run_id``."""
        return _matches(run_id, self.runs)


def _matches(name: str, globs: tuple[str, ...]) -> bool:
    return not globs or any(fnmatch.fnmatchcase(name, glob) for glob in globs)


CALLER: contextvars.ContextVar[Grant | None] = contextvars.ContextVar("caller", default=None)
"""While a call whose token is limited to runs or engines is served, its grant (set by the
token checks): what its answer may show (Status lists only its runs). None otherwise."""


def parse_tokens(
    text: str,
    source: str,
    roles: Mapping[str, Role] = _ALL,
    default_role: str = ADMIN,
    scoped: bool = True,
) -> dict[str, Grant]:
    """The tokens of a tokens file's ``text``, each to its grant (``roles``: those a line
    may name; ``default_role``: a line's that names none; ``scoped``: whether a line may
    narrow its token with ``runs=`` and ``engines=``, which mean something to the
    scheduler's calls only). ValueError names ``source``, the
    line and what is wrong with it; never a token, nor a name as long as one (a name and a
    token swapped)."""
    tokens: dict[str, Grant] = {}
    names: dict[str, int] = {}  # -> its line
    lines: dict[str, int] = {}  # token -> its line
    for number, raw in enumerate(text.removeprefix("\ufeff").splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, rest = line.partition(":")
        token, *options = rest.split() or [""]
        where = f"{source}, line {number}"
        if not sep:
            raise ValueError(f"{where}: expected NAME:TOKEN (no ':' found)")
        if not _NAME.fullmatch(name):
            raise ValueError(
                f"{where}: the name{_shown(name)} must be 1 to 64 letters, digits or '_.-'"
            )
        if rest[:1].isspace() or not rest or token.startswith(("role=", "runs=")):
            raise ValueError(
                f"{where}: no token after the name{_shown(name)}: NAME:TOKEN, no space"
            )
        if not _TOKEN.fullmatch(token):
            raise ValueError(
                f"{where}: the token must be {MIN_TOKEN_CHARS} to {MAX_TOKEN_CHARS} visible "
                f"ASCII characters without spaces (it has {len(token)}); make one with "
                "`openssl rand -hex 32`"
            )
        if name in names:
            raise ValueError(f"{where}: the name{_shown(name)} is line {names[name]}'s too")
        if token in tokens:
            raise ValueError(f"{where}: the token is line {lines[token]}'s too")
        names[name], lines[token] = number, number
        role, scopes = _options(options, where, roles, default_role)
        if scopes and not scoped:
            raise ValueError(
                f"{where}: {' and '.join(f'{key}=' for key in scopes)} narrow a token to "
                "the scheduler's runs or engines, which this server's calls do not name: "
                "give its tokens without them"
            )
        tokens[token] = Grant(name, role, roles[role].calls, **scopes)
    if not tokens:
        raise ValueError(f"{source}: no token in it (one NAME:TOKEN a line)")
    return tokens


def _shown(name: str) -> str:
    """`` 'NAME'`` for an error, for a name too short to be a token; else nothing."""
    return f" {name!r}" if len(name) < MIN_TOKEN_CHARS and _NAME.fullmatch(name) else ""


_SCOPES = {"runs": "run", "engines": "engine"}  # option -> what its globs name


def _options(
    options: list[str], where: str, roles: Mapping[str, Role], default_role: str
) -> tuple[str, dict[str, tuple[str, ...]]]:
    """A token's line's ``role=``, ``runs=`` and ``engines=`` (what follows its token): (its
    role, the globs of each scope given)."""
    given: dict[str, str] = {}
    for option in options:
        key, eq, value = option.partition("=")
        if (key != "role" and key not in _SCOPES) or not eq:
            # (never shown: it may be the rest of a token that has a space in it)
            raise ValueError(
                f"{where}: after the token comes something that is none of role=ROLE, "
                "runs=GLOB,... and engines=GLOB,... (a token has no spaces)"
            )
        if key in given:
            raise ValueError(f"{where}: {key}= is given twice")
        given[key] = value
    role = given.pop("role", default_role)
    if role not in roles:
        raise ValueError(
            f"{where}: role {role[:_NAME_SHOWN_CHARS]!r} is not one of {', '.join(roles)}"
        )
    scopes = {key: tuple(value.split(",")) for key, value in given.items()}
    for key, globs in scopes.items():
        for glob in globs:
            if not _GLOB.fullmatch(glob):
                raise ValueError(
                    f"{where}: {key}= takes {_SCOPES[key]} ids or globs of them (letters, "
                    f"digits, '_.-', '*' and '?'), comma-separated; not "
                    f"{glob[:_NAME_SHOWN_CHARS]!r}"
                )
    return role, scopes


def _read_tokens(
    path: Path, roles: Mapping[str, Role], default_role: str, scoped: bool
) -> dict[str, Grant]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: cannot read the tokens file: {exc}") from exc
    return parse_tokens(text, str(path), roles, default_role, scoped)


def _stamp(path: Path) -> tuple[int, int, int, int] | None:
    """What changes when the file is replaced or rewritten (None: it cannot be read now)."""
    try:
        stat = path.stat()  # (a Kubernetes Secret's file is a link to the current version)
    except OSError:
        return None
    return (stat.st_ino, stat.st_mtime_ns, stat.st_size, stat.st_ctime_ns)  # (ctime: a chmod)


class TokenFile:
    """The tokens of a tokens file (see the module), read at once (a ValueError says what is
    wrong) and again when the file changes, checked at most every ``reload_interval_s``.
    ``roles``: those its lines may name; ``default_role``: a line's that names none."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        roles: Mapping[str, Role] = _ALL,
        default_role: str = ADMIN,
        scoped: bool = True,
        reload_interval_s: float = RELOAD_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if default_role not in roles:
            raise ValueError(f"the default role {default_role!r} is not one of {', '.join(roles)}")
        self.path = Path(path)
        self._roles = dict(roles)
        self._scoped = scoped
        self._default_role = default_role
        self._interval_s = reload_interval_s
        self._clock = clock
        self._stamp = _stamp(self.path)
        self._tokens = _read_tokens(self.path, self._roles, default_role, scoped)
        self._checked = clock()

    @property
    def names(self) -> tuple[str, ...]:
        """Whose tokens are accepted now."""
        self._refresh()
        return tuple(sorted(grant.name for grant in self._tokens.values()))

    def caller(self, authorization: str | None) -> tuple[Grant | None, str]:
        """The grant of the token ``authorization`` (``Bearer TOKEN``, as sent) carries:
        (it, ""); or (None, why the call is refused)."""
        self._refresh()
        if not authorization:
            return None, (
                "no credentials: send 'authorization: Bearer <token>' with a token of the "
                "server's tokens file"
            )
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None, "the authorization must read 'Bearer <token>'"
        given = token.strip().encode("utf-8", "replace")
        found: Grant | None = None
        for known, grant in self._tokens.items():  # (each compared in constant time)
            if hmac.compare_digest(given, known.encode()):
                found = grant
        if found is None:
            return None, (
                "the bearer token is not one the server accepts (a token added to its tokens "
                f"file counts within {self._interval_s:g} s)"
            )
        return found, ""

    def _refresh(self) -> None:
        now = self._clock()
        if now - self._checked < self._interval_s:
            return
        self._checked = now
        stamp = _stamp(self.path)
        if stamp is None or stamp == self._stamp:
            if stamp is None:
                log.error("%s: cannot read the tokens file; the tokens read before stay", self.path)
            return
        self._stamp = stamp
        try:
            tokens = _read_tokens(self.path, self._roles, self._default_role, self._scoped)
        except ValueError as exc:
            log.error("%s; the tokens read before stay", exc)
            return
        self._tokens = tokens
        log.info("%s: read again: %d tokens", self.path, len(tokens))


class BearerFile:
    """The token a client shows, kept alone in a file (a Secret's key), read at once (a
    ValueError names the file) and again when the file changes, looked at every
    ``reload_interval_s`` at most: the server's tokens rotate without the client's restart.
    A rewrite that holds no token keeps the one read before, and says why in the log."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        reload_interval_s: float = RELOAD_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = Path(path)
        self._watch = _Watch((self.path,), reload_interval_s, clock)
        self._token = self._read()

    def _read(self) -> str:
        try:
            token = self.path.read_text(encoding="utf-8").removeprefix("\ufeff").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"{self.path}: cannot read the token file: {exc}") from exc
        if not _TOKEN.fullmatch(token):
            raise ValueError(
                f"{self.path}: the token file must hold one token alone, {MIN_TOKEN_CHARS} to "
                f"{MAX_TOKEN_CHARS} visible ASCII characters (it holds {len(token)})"
            )
        return token

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """The call metadata that shows the token."""
        if self._watch.changed():
            try:
                self._token = self._read()
                log.info("%s: read again", self.path)
            except ValueError as exc:
                log.error("%s; the token read before stays", exc)
        return (("authorization", f"Bearer {self._token}"),)


class _RefusalLog:
    """Logs refused calls, one line at most every ``REFUSAL_LOG_INTERVAL_S`` (a scanner
    sends thousands), with how many went unlogged since."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._last = -REFUSAL_LOG_INTERVAL_S
        self._unlogged = 0
        self.refused = 0  # calls refused since start

    def __call__(self, what: str, peer: str, reason: str) -> None:
        self.refused += 1
        now = self._clock()
        if now - self._last < REFUSAL_LOG_INTERVAL_S:
            self._unlogged += 1
            return
        more = (
            f" ({self._unlogged} more refused since the last such line)" if self._unlogged else ""
        )
        log.warning("refused %s from %s: %s%s", what, peer, reason, more)
        self._last, self._unlogged = now, 0


class GrpcTokenCheck(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    """Refuses each call of a method outside ``open_prefixes``: with UNAUTHENTICATED when
    its ``authorization`` metadata carries no token of ``tokens``, with PERMISSION_DENIED
    when the token's grant does not cover the method (its name after the last ``/``) or the
    ``run_id`` of its request."""

    def __init__(
        self, tokens: TokenFile, open_prefixes: tuple[str, ...] = OPEN_GRPC_PREFIXES
    ) -> None:
        self._tokens = tokens
        self._open = open_prefixes
        self._log = _RefusalLog()

    @property
    def refused(self) -> int:
        return self._log.refused

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any]]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any]:
        method = handler_call_details.method
        if method.startswith(self._open):
            return await continuation(handler_call_details)
        given = [
            value
            for key, value in handler_call_details.invocation_metadata or ()
            if key == "authorization"
        ]
        if len(given) > 1:
            return _refusing(method, _TWICE, self._log)
        authorization = given[0] if given and isinstance(given[0], str) else None
        grant, reason = self._tokens.caller(authorization)
        if grant is None:
            return _refusing(method, reason, self._log)
        denied = grant.refuses(method.rpartition("/")[2])
        if denied:
            return _refusing(method, denied, self._log, grpc.StatusCode.PERMISSION_DENIED)
        handler = await continuation(handler_call_details)
        if not grant.scoped or handler is None:
            return handler
        return _checking_scopes(method, handler, grant, self._log)


def _refusing(
    method: str,
    reason: str,
    refusal_log: _RefusalLog,
    code: grpc.StatusCode = grpc.StatusCode.UNAUTHENTICATED,
) -> grpc.RpcMethodHandler[Any, Any]:
    """A handler that refuses the call with ``code``, whatever its kind, without reading its
    request."""

    async def refuse(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        refusal_log(method, context.peer(), reason)
        await context.abort(code, reason)

    # grpc reads the request's first message before ``refuse`` runs (within the server's
    # message size limit) but nothing decodes it: it is bytes to ``refuse``, whichever kind
    # the method is, so one handler serves every kind.
    return grpc.unary_unary_rpc_method_handler(refuse)


def _checking_scopes(
    method: str,
    handler: grpc.RpcMethodHandler[Any, Any],
    grant: Grant,
    refusal_log: _RefusalLog,
) -> grpc.RpcMethodHandler[Any, Any]:
    """``handler``, refusing (PERMISSION_DENIED) a request whose ``run_id`` or ``engine_id``
    the scoped ``grant`` does not cover. Only unary calls are checked so: a streaming one is
    refused whole (the scheduler serves none)."""
    behaviour: Callable[..., Any] | None = handler.unary_unary
    if behaviour is None:
        why = f"the token {grant.name!r} is limited to runs or engines and {method} streams"
        return _refusing(method, why, refusal_log, grpc.StatusCode.PERMISSION_DENIED)

    async def checked(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        fields = request.DESCRIPTOR.fields_by_name
        denied = grant.refuses(
            method.rpartition("/")[2],
            request.run_id if "run_id" in fields else None,
            request.engine_id if "engine_id" in fields else None,
        )
        if denied:
            refusal_log(method, context.peer(), denied)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, denied)
        token = CALLER.set(grant)  # (this call's own task: no other call sees it)
        try:
            answer = behaviour(request, context)
            return await answer if inspect.isawaitable(answer) else answer
        finally:
            CALLER.reset(token)

    return grpc.unary_unary_rpc_method_handler(
        checked,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


def http_token_check(
    tokens: TokenFile,
    open_paths: Collection[str],
    refusal: Callable[[str], web.Response],
    denial: Callable[[str], web.Response],
    call_of: Callable[[web.Request], tuple[str, str | None] | None] = lambda request: None,
) -> Middleware:
    """An aiohttp middleware that answers ``refusal(reason)`` (status 401, its
    ``WWW-Authenticate`` set here) to a request for a path outside ``open_paths`` whose
    ``Authorization`` header carries no token of ``tokens``, and ``denial(reason)`` (403) to
    one whose token's grant does not cover it: ``call_of`` says which call a request makes
    and on which run, (call, run_id or None), or None for a path of no call (then a token is
    enough)."""
    refusal_log = _RefusalLog()

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in open_paths:
            return await handler(request)
        values = request.headers.getall("Authorization", [])
        given = values[0] if values else None
        grant, reason = tokens.caller(given) if len(values) < 2 else (None, _TWICE)
        what = f"{request.method} {request.path}"
        if grant is None:
            refusal_log(what, str(request.remote), reason)
            response = refusal(reason)
            challenge = 'Bearer realm="rollserve"'
            response.headers["WWW-Authenticate"] = (
                challenge if not given else f'{challenge}, error="invalid_token"'
            )
            return response
        call = call_of(request)
        denied = "" if call is None else grant.refuses(*call)
        if denied:
            refusal_log(what, str(request.remote), denied)
            return denial(denied)
        if not grant.scoped:
            return await handler(request)
        token = CALLER.set(grant)
        try:
            return await handler(request)
        finally:
            CALLER.reset(token)

    return check


def _no_password() -> str:
    """For an encrypted key: OpenSSL would ask a terminal for the password (and a service has
    none to ask); gRPC takes unencrypted keys only anyway."""
    raise ValueError("the key is encrypted; give it unencrypted (a file only the service reads)")


def _file_bytes(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ValueError(f"{what} {path}: cannot read it: {exc}") from exc


class _Watch:
    """Whether files changed since the last look, looked at every ``interval_s`` at most;
    safe from any thread (gRPC asks from its own)."""

    def __init__(
        self, paths: tuple[Path, ...], interval_s: float, clock: Callable[[], float]
    ) -> None:
        self._paths = paths
        self._interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._stamps = self._now()
        self._checked = clock()

    def _now(self) -> tuple[tuple[int, int, int, int] | None, ...]:
        return tuple(_stamp(path) for path in self._paths)

    def changed(self) -> bool:
        with self._lock:
            now = self._clock()
            if now - self._checked < self._interval_s:
                return False
            self._checked = now
            stamps = self._now()
            if stamps == self._stamps or None in stamps:  # (one being replaced: next look)
                return False
            self._stamps = stamps
            return True

    def again(self) -> None:
        """Makes the next look (after the interval) see a change, whatever the files are."""
        with self._lock:
            self._stamps = ()


@dataclass(frozen=True)
class ServerTls:
    """A server's certificate chain and key (PEM files), and the CA of its callers'
    certificates for mutual TLS (None: callers show none).

    The servers it makes look at the files again every ``reload_interval_s`` at most, at a
    new connection, and take what changed (a certificate renewed, by cert-manager, say)
    from the next handshake on, without a restart. Files that do not make a valid set (a
    key that is not the certificate's, one of them being written) leave the set read
    before in place; the log says why."""

    cert_file: Path
    key_file: Path
    client_ca_file: Path | None = None
    reload_interval_s: float = RELOAD_INTERVAL_S
    clock: Callable[[], float] = time.monotonic

    @classmethod
    def load(
        cls,
        cert_file: str | os.PathLike[str],
        key_file: str | os.PathLike[str],
        client_ca_file: str | os.PathLike[str] | None = None,
        reload_interval_s: float = RELOAD_INTERVAL_S,
    ) -> ServerTls:
        """Checked now: ValueError names the file that cannot be read or the pair that does
        not match."""
        tls = cls(
            Path(cert_file),
            Path(key_file),
            None if client_ca_file is None else Path(client_ca_file),
            reload_interval_s,
        )
        tls._context()
        return tls

    @classmethod
    def from_settings(
        cls, cert_file: str | None, key_file: str | None, client_ca_file: str | None
    ) -> ServerTls | None:
        """A server's TLS from its ``tls_cert_file``, ``tls_key_file`` and
        ``tls_client_ca_file`` settings, checked now (None: plaintext); ValueError names the
        setting given without its partner, or the file that cannot be used."""
        if (cert_file is None) != (key_file is None):
            raise ValueError("tls_cert_file and tls_key_file: give both (TLS) or neither")
        if client_ca_file is not None and cert_file is None:
            raise ValueError(
                "tls_client_ca_file needs tls_cert_file and tls_key_file: mutual TLS is TLS"
            )
        if cert_file is None or key_file is None:
            return None
        return cls.load(cert_file, key_file, client_ca_file)

    @property
    def _paths(self) -> tuple[Path, ...]:
        ca = () if self.client_ca_file is None else (self.client_ca_file,)
        return (self.cert_file, self.key_file, *ca)

    def _material(self) -> tuple[bytes, bytes, bytes | None]:
        """The files' bytes: (certificate chain, key, client CA or None)."""
        chain = _file_bytes(self.cert_file, "the certificate")
        key = _file_bytes(self.key_file, "the key")
        client_ca = (
            None
            if self.client_ca_file is None
            else _file_bytes(self.client_ca_file, "the client CA")
        )
        return chain, key, client_ca

    def _context(self) -> ssl.SSLContext:
        """A server context of the files as they are now (TLS 1.2 at least)."""
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        _file_bytes(self.cert_file, "the certificate")
        _file_bytes(self.key_file, "the key")
        try:
            context.load_cert_chain(self.cert_file, self.key_file, password=_no_password)
        except (ssl.SSLError, OSError, ValueError) as exc:
            raise ValueError(
                f"the certificate {self.cert_file} and the key {self.key_file}: not a PEM "
                f"certificate chain and its key, unencrypted: {exc}"
            ) from exc
        if self.client_ca_file is not None:
            _file_bytes(self.client_ca_file, "the client CA")
            try:
                context.load_verify_locations(cafile=self.client_ca_file)
            except (ssl.SSLError, OSError) as exc:
                raise ValueError(
                    f"the client CA {self.client_ca_file}: not PEM certificates: {exc}"
                ) from exc
            context.verify_mode = ssl.CERT_REQUIRED
            # A resumed session skips the certificate check: a client whose CA was taken out
            # could go on resuming one made before. TLS 1.3 without tickets resumes nothing
            # (TLS 1.2 would still resume from the session cache, which ssl cannot turn off).
            context.minimum_version = ssl.TLSVersion.TLSv1_3
            context.num_tickets = 0
            context.options |= ssl.OP_NO_TICKET
        return context

    def _reloaded(self, watch: _Watch) -> tuple[ssl.SSLContext, bytes, bytes, bytes | None] | None:
        """The files again, once ``watch`` saw them change and they make a valid set: (its
        context, chain, key, client CA); None otherwise."""
        if not watch.changed():
            return None
        try:
            material = self._material()
            context = self._context()  # (checks that they match)
            if self._material() != material:  # (written meanwhile: the next look)
                watch.again()
                return None
        except ValueError as exc:
            log.error("%s; the certificate read before stays", exc)
            return None
        log.info("%s: read again, for new connections", self.cert_file)
        return (context, *material)

    def ssl_context(self) -> ssl.SSLContext:
        """For an HTTPS server: a context of the files as they are now, which moves each
        new connection to the files' latest valid set."""
        base = self._context()
        watch = _Watch(self._paths, self.reload_interval_s, self.clock)
        latest = [base]

        def pick(
            connection: ssl.SSLObject | ssl.SSLSocket, server_name: str | None, _: Any
        ) -> None:
            # (OpenSSL asks before it reads the client's hello further, with or without SNI)
            try:
                reloaded = self._reloaded(watch)
            except Exception:  # (raised here, it would fail the handshake)
                log.exception("%s: reading it again failed", self.cert_file)
                reloaded = None
            if reloaded is not None:
                latest[0] = reloaded[0]
            if latest[0] is not base:
                connection.context = latest[0]

        base.sni_callback = pick
        return base

    def grpc_credentials(self) -> grpc.ServerCredentials:
        """For a gRPC server's secure port, which takes the files' latest valid set at each
        new connection."""
        chain, key, client_ca = self._material()
        watch = _Watch(self._paths, self.reload_interval_s, self.clock)

        def fetch() -> grpc.ServerCertificateConfiguration | None:
            try:
                reloaded = self._reloaded(watch)
            except Exception:  # (raised into gRPC's core, it would fail the connection)
                log.exception("%s: reading it again failed", self.cert_file)
                return None
            if reloaded is None:
                return None
            _, chain, key, client_ca = reloaded
            return grpc.ssl_server_certificate_configuration(
                [(key, chain)], root_certificates=client_ca
            )

        return grpc.dynamic_ssl_server_credentials(
            grpc.ssl_server_certificate_configuration([(key, chain)], root_certificates=client_ca),
            cast(Callable[[], grpc.ServerCertificateConfiguration], fetch),  # (None: no change)
            require_client_authentication=client_ca is not None,
        )


class _Changing(ValueError):
    """Files changed while they were read and checked."""


class ClientTls:
    """What a client reaches TLS servers with: the CA that signed their certificates, and for
    mutual TLS the certificate chain and key it shows them (PEM files).

    The files are looked at again every ``reload_interval_s`` at most, when asked for the
    credentials; a set that changed and is valid (the CA parses, the key is the
    certificate's) is taken, and ``generation`` counts up: connections opened from then on
    should use it. One that is not (a file being written) leaves the set read before, and
    says why in the log. gRPC fixes a channel's credentials when it is made: a client takes
    new ones by opening a new channel."""

    def __init__(
        self,
        ca_file: str | os.PathLike[str],
        cert_file: str | os.PathLike[str] | None = None,
        key_file: str | os.PathLike[str] | None = None,
        *,
        names: tuple[str, str, str] = ("the CA", "the certificate", "the key"),
        reload_interval_s: float = RELOAD_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Reads and checks the files now: ValueError names the one that cannot be read or
        the pair that does not match, as ``names`` call the CA, certificate and key (the
        settings that gave them, say)."""
        self._names = names
        if (cert_file is None) != (key_file is None):
            raise ValueError(f"{names[1]} and {names[2]}: give both or neither")
        self.ca_file = Path(ca_file)
        self.cert_file = None if cert_file is None else Path(cert_file)
        self.key_file = None if key_file is None else Path(key_file)
        paths = tuple(p for p in (self.ca_file, self.cert_file, self.key_file) if p is not None)
        self._watch = _Watch(paths, reload_interval_s, clock)
        self._lock = threading.Lock()
        self.generation = 0
        self._credentials = self._load()

    def _material(self) -> tuple[bytes, bytes | None, bytes | None]:
        ca = _file_bytes(self.ca_file, self._names[0])
        if self.cert_file is None or self.key_file is None:
            return ca, None, None
        return (
            ca,
            _file_bytes(self.cert_file, self._names[1]),
            _file_bytes(self.key_file, self._names[2]),
        )

    def _load(self) -> grpc.ChannelCredentials:
        """Credentials of the files as they are now, checked."""
        ca, chain, key = self._material()
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
        try:
            context.load_verify_locations(cadata=ca.decode("ascii"))
        except (ssl.SSLError, ValueError) as exc:  # (UnicodeDecodeError is a ValueError)
            raise ValueError(
                f"{self._names[0]} {self.ca_file}: not PEM certificates: {exc}"
            ) from exc
        if self.cert_file is not None and self.key_file is not None:
            try:
                context.load_cert_chain(self.cert_file, self.key_file, password=_no_password)
            except (ssl.SSLError, OSError, ValueError) as exc:
                _, cert_name, key_name = self._names
                raise ValueError(
                    f"{cert_name} {self.cert_file} and {key_name} {self.key_file}: not a PEM "
                    f"certificate chain and its key, unencrypted: {exc}"
                ) from exc
        if self._material() != (ca, chain, key):  # (written meanwhile: checked another set)
            raise _Changing(f"{self.ca_file}: its files changed while they were read")
        return grpc.ssl_channel_credentials(
            root_certificates=ca, private_key=key, certificate_chain=chain
        )

    def credentials(self) -> tuple[int, grpc.ChannelCredentials]:
        """The latest valid set, and its generation."""
        if self._watch.changed():
            try:
                credentials = self._load()
            except _Changing:
                self._watch.again()  # (the next look reads them again)
            except ValueError as exc:
                log.error("%s; the credentials read before stay", exc)
            else:
                with self._lock:
                    self._credentials = credentials
                    self.generation += 1
                files = ", ".join(str(p) for p in (self.ca_file, self.cert_file) if p)
                log.info("%s: read again, for new connections", files)
        with self._lock:
            return self.generation, self._credentials
