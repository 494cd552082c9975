"""Who may call a service: TLS on its servers, bearer tokens on its calls.

**Tokens.** A tokens file holds one token a line, as ``NAME:TOKEN``; blank lines and lines
that start with ``#`` are skipped. NAME (letters, digits, ``_.-``, 64 at most) says whose the
token is in the service's log; TOKEN is 16 to 4096 visible ASCII characters (``openssl rand
-hex 32`` makes one). A call carries its token as ``authorization: Bearer TOKEN`` (gRPC
metadata, or the HTTP header). The file is read again within ``reload_interval_s`` of a
change (a Kubernetes Secret updated in place), so tokens rotate without a restart: add the
new one, move the callers to it, remove the old. A file that no longer parses keeps the
tokens read before, and says why in the log.

**TLS.** A server certificate and its key (PEM); with a client CA, callers must show a
certificate it signed (mutual TLS). Certificates are read at start: restart to rotate them.

Health checks stay open (orchestrators probe without credentials), as does gRPC reflection
(the schema, nothing of the state); the HTTP server's open paths are its owner's choice.
"""

from __future__ import annotations

import hmac
import logging
import os
import re
import ssl
import time
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

__all__ = [
    "OPEN_GRPC_PREFIXES",
    "GrpcTokenCheck",
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

_TWICE = "the authorization is given more than once: give one"
_NAME_SHOWN_CHARS = 80  # of a name that is not one, in the error

OPEN_GRPC_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
"""gRPC methods called without a token: health checks and reflection."""


def parse_tokens(text: str, source: str) -> dict[str, str]:
    """The tokens of a tokens file's ``text``, each to its name. ValueError names ``source``,
    the line and what is wrong with it (never the token itself)."""
    tokens: dict[str, str] = {}
    names: set[str] = set()
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, token = line.partition(":")
        where = f"{source}, line {number}"
        if not sep:
            raise ValueError(f"{where}: expected NAME:TOKEN (no ':' found)")
        if not _NAME.fullmatch(name):
            raise ValueError(
                f"{where}: the name {name[:_NAME_SHOWN_CHARS]!r} must be 1 to 64 letters, "
                "digits or '_.-'"
            )
        if not _TOKEN.fullmatch(token):
            raise ValueError(
                f"{where}: the token of {name!r} must be {MIN_TOKEN_CHARS} to "
                f"{MAX_TOKEN_CHARS} visible ASCII characters without spaces (it has "
                f"{len(token)}); make one with `openssl rand -hex 32`"
            )
        if name in names:
            raise ValueError(f"{where}: the name {name!r} is given twice")
        if token in tokens:
            raise ValueError(f"{where}: the token of {name!r} is {tokens[token]!r}'s too")
        names.add(name)
        tokens[token] = name
    if not tokens:
        raise ValueError(f"{source}: no token in it (one NAME:TOKEN a line)")
    return tokens


def _read_tokens(path: Path) -> dict[str, str]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: cannot read the tokens file: {exc}") from exc
    return parse_tokens(text, str(path))


def _stamp(path: Path) -> tuple[int, int, int] | None:
    """What changes when the file is replaced or rewritten (None: it cannot be read now)."""
    try:
        stat = path.stat()  # (a Kubernetes Secret's file is a link to the current version)
    except OSError:
        return None
    return (stat.st_ino, stat.st_mtime_ns, stat.st_size)


class TokenFile:
    """The tokens of a tokens file (see the module), read at once (a ValueError says what is
    wrong) and again when the file changes, checked at most every ``reload_interval_s``."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        reload_interval_s: float = RELOAD_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = Path(path)
        self._interval_s = reload_interval_s
        self._clock = clock
        self._stamp = _stamp(self.path)
        self._tokens = _read_tokens(self.path)
        self._checked = clock()

    @property
    def names(self) -> tuple[str, ...]:
        """Whose tokens are accepted now."""
        self._refresh()
        return tuple(sorted(self._tokens.values()))

    def caller(self, authorization: str | None) -> tuple[str | None, str]:
        """Whose token ``authorization`` (``Bearer TOKEN``, as sent) carries: (the name, "");
        or (None, why the call is refused)."""
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
        found: str | None = None
        for known, name in self._tokens.items():  # (each compared in constant time)
            if hmac.compare_digest(given, known.encode()):
                found = name
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
            tokens = _read_tokens(self.path)
        except ValueError as exc:
            log.error("%s; the tokens read before stay", exc)
            return
        self._tokens = tokens
        log.info("%s: read again: %d tokens", self.path, len(tokens))


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
    """Refuses with UNAUTHENTICATED each call of a method outside ``open_prefixes`` whose
    ``authorization`` metadata carries no token of ``tokens``."""

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
        name, reason = self._tokens.caller(authorization)
        if name is not None:
            return await continuation(handler_call_details)
        return _refusing(method, reason, self._log)


def _refusing(
    method: str, reason: str, refusal_log: _RefusalLog
) -> grpc.RpcMethodHandler[Any, Any]:
    """A handler that refuses the call, whatever its kind, without reading its request."""

    async def refuse(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        refusal_log(method, context.peer(), reason)
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)

    # grpc reads the request's first message before ``refuse`` runs (within the server's
    # message size limit) but nothing decodes it: it is bytes to ``refuse``, whichever kind
    # the method is, so one handler serves every kind.
    return grpc.unary_unary_rpc_method_handler(refuse)


def http_token_check(
    tokens: TokenFile,
    open_paths: Collection[str],
    refusal: Callable[[str], web.Response],
) -> Middleware:
    """An aiohttp middleware that answers ``refusal(reason)`` (status 401, its
    ``WWW-Authenticate`` set here) to a request for a path outside ``open_paths`` whose
    ``Authorization`` header carries no token of ``tokens``."""
    refusal_log = _RefusalLog()

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in open_paths:
            return await handler(request)
        values = request.headers.getall("Authorization", [])
        given = values[0] if values else None
        name, reason = tokens.caller(given) if len(values) < 2 else (None, _TWICE)
        if name is not None:
            return await handler(request)
        refusal_log(f"{request.method} {request.path}", str(request.remote), reason)
        response = refusal(reason)
        challenge = 'Bearer realm="rollserve"'
        response.headers["WWW-Authenticate"] = (
            challenge if not given else f'{challenge}, error="invalid_token"'
        )
        return response

    return check


def _no_password() -> str:
    """For an encrypted key: OpenSSL would ask a terminal for the password (and a service has
    none to ask); gRPC takes unencrypted keys only anyway."""
    raise ValueError("the key is encrypted; give it unencrypted (a file only the service reads)")


@dataclass(frozen=True)
class ServerTls:
    """A server's certificate chain and key (PEM files), and the CA of its callers'
    certificates for mutual TLS (None: callers show none)."""

    cert_file: Path
    key_file: Path
    client_ca_file: Path | None = None

    @classmethod
    def load(
        cls,
        cert_file: str | os.PathLike[str],
        key_file: str | os.PathLike[str],
        client_ca_file: str | os.PathLike[str] | None = None,
    ) -> ServerTls:
        """Checked now: ValueError names the file that cannot be read or the pair that does
        not match."""
        tls = cls(
            Path(cert_file),
            Path(key_file),
            None if client_ca_file is None else Path(client_ca_file),
        )
        tls.ssl_context()
        return tls

    def _read(self, path: Path, what: str) -> bytes:
        try:
            return path.read_bytes()
        except OSError as exc:
            raise ValueError(f"{what} {path}: cannot read it: {exc}") from exc

    def ssl_context(self) -> ssl.SSLContext:
        """For an HTTPS server (TLS 1.2 at least)."""
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        self._read(self.cert_file, "the certificate")
        self._read(self.key_file, "the key")
        try:
            context.load_cert_chain(self.cert_file, self.key_file, password=_no_password)
        except (ssl.SSLError, OSError, ValueError) as exc:
            raise ValueError(
                f"the certificate {self.cert_file} and the key {self.key_file}: not a PEM "
                f"certificate chain and its key, unencrypted: {exc}"
            ) from exc
        if self.client_ca_file is not None:
            self._read(self.client_ca_file, "the client CA")
            try:
                context.load_verify_locations(cafile=self.client_ca_file)
            except ssl.SSLError as exc:
                raise ValueError(
                    f"the client CA {self.client_ca_file}: not PEM certificates: {exc}"
                ) from exc
            context.verify_mode = ssl.CERT_REQUIRED
        return context

    def grpc_credentials(self) -> grpc.ServerCredentials:
        """For a gRPC server's secure port."""
        chain = self._read(self.cert_file, "the certificate")
        key = self._read(self.key_file, "the key")
        client_ca = (
            None
            if self.client_ca_file is None
            else self._read(self.client_ca_file, "the client CA")
        )
        return grpc.ssl_server_credentials(
            [(key, chain)], root_certificates=client_ca, require_client_auth=client_ca is not None
        )
