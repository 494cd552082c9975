"""How a client reaches a scheduler that asks for credentials: TLS, a bearer token, or both.

A scheduler started with ``--tls-cert-file`` takes TLS connections only; one started with
``--auth-tokens-file`` refuses calls (UNAUTHENTICATED) that carry no token of that file; one
with ``--tls-client-ca-file`` wants the client's certificate too (mutual TLS)::

    credentials = SchedulerCredentials.from_files(token_file="/run/secrets/rollserve-token",
                                                  ca_file="/etc/rollserve/ca.pem")
    client = RolloutClient(address, redis_url, run_id, credentials=credentials)

The token travels in the ``authorization`` metadata of every call. Without TLS it travels in
clear: fine on a loopback or inside a mesh that encrypts (Istio, Linkerd), not across an open
network. Redis has credentials of its own, in its URL (``rediss://user:password@host``).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import grpc

__all__ = ["NO_CREDENTIALS", "SchedulerCredentials"]

_TOKEN = re.compile(r"[\x21-\x7e]+")


def _read(path: str | os.PathLike[str], what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{what} {os.fspath(path)}: cannot read it: {exc}") from exc


@dataclass(frozen=True)
class SchedulerCredentials:
    """What a client shows a scheduler.

    token: the bearer token (one of the scheduler's tokens file), or None.
    tls: connect over TLS; implied by the fields below.
    ca_pem: the CA certificates that signed the scheduler's certificate (PEM); None trusts
        the public roots gRPC bundles (not the system's store: an internal CA goes here).
    cert_pem, key_pem: the client's certificate chain and key, for a scheduler that wants
        one (mutual TLS); both or neither.
    server_name: the name the scheduler's certificate must carry, when the address does not
        (an IP address, a tunnel); None checks the address's host.
    """

    token: str | None = field(default=None, repr=False)
    tls: bool = False
    ca_pem: bytes | None = field(default=None, repr=False)
    cert_pem: bytes | None = field(default=None, repr=False)
    key_pem: bytes | None = field(default=None, repr=False)
    server_name: str | None = None

    def __post_init__(self) -> None:
        if self.token is not None and not _TOKEN.fullmatch(self.token):
            raise ValueError(
                "token: must be visible ASCII characters without spaces (as a tokens file "
                "holds it); is a newline or a 'Bearer ' prefix in it?"
            )
        if (self.cert_pem is None) != (self.key_pem is None):
            raise ValueError("cert_pem and key_pem: give both (mutual TLS) or neither")
        if self.server_name is not None and not self.secure:
            raise ValueError("server_name: only for TLS (set tls, or ca_pem)")

    @classmethod
    def from_files(
        cls,
        *,
        token_file: str | os.PathLike[str] | None = None,
        ca_file: str | os.PathLike[str] | None = None,
        cert_file: str | os.PathLike[str] | None = None,
        key_file: str | os.PathLike[str] | None = None,
        tls: bool = False,
        server_name: str | None = None,
    ) -> SchedulerCredentials:
        """Read from files (a Kubernetes Secret, say): the token file holds the token alone,
        surrounding whitespace ignored. ValueError names a file that cannot be read."""
        token = None
        if token_file is not None:
            token = _read(token_file, "token_file").decode("utf-8", "replace").strip()
            if not _TOKEN.fullmatch(token):
                raise ValueError(
                    f"token_file {os.fspath(token_file)}: it must hold the token alone, "
                    "visible ASCII characters without spaces"
                    + (" (it is empty)" if not token else "")
                )
        return cls(
            token=token,
            tls=tls,
            ca_pem=None if ca_file is None else _read(ca_file, "ca_file"),
            cert_pem=None if cert_file is None else _read(cert_file, "cert_file"),
            key_pem=None if key_file is None else _read(key_file, "key_file"),
            server_name=server_name,
        )

    @property
    def secure(self) -> bool:
        """Whether the connection is over TLS."""
        return self.tls or self.ca_pem is not None or self.cert_pem is not None

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """What each call carries (the token)."""
        return () if self.token is None else (("authorization", f"Bearer {self.token}"),)

    def _options(self, options: tuple[tuple[str, object], ...]) -> list[tuple[str, object]]:
        out = list(options)
        if self.server_name is not None:
            out.append(("grpc.ssl_target_name_override", self.server_name))
        return out

    def _channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca_pem, private_key=self.key_pem, certificate_chain=self.cert_pem
        )

    def channel(self, address: str, options: tuple[tuple[str, object], ...] = ()) -> grpc.Channel:
        """A channel to the scheduler at ``address``, TLS or not (the token is not in it:
        pass ``metadata`` with each call)."""
        if self.secure:
            return grpc.secure_channel(
                address, self._channel_credentials(), options=self._options(options)
            )
        return grpc.insecure_channel(address, options=list(options))

    def aio_channel(
        self, address: str, options: tuple[tuple[str, object], ...] = ()
    ) -> grpc.aio.Channel:
        """The asyncio twin of ``channel``."""
        if self.secure:
            return grpc.aio.secure_channel(
                address, self._channel_credentials(), options=self._options(options)
            )
        return grpc.aio.insecure_channel(address, options=list(options))


NO_CREDENTIALS = SchedulerCredentials()
"""A plaintext channel, no token: a scheduler that asks for nothing."""
