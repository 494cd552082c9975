"""host:port addresses, as every rollserve service and command reads and writes them."""

from __future__ import annotations

import ipaddress
import re

# A DNS name's label: letters, digits, '-' and '_' (names of hosts inside clusters carry it),
# not starting or ending with '-'.
_LABEL = re.compile(r"(?!-)[A-Za-z0-9_-]{1,63}(?<!-)")
_MAX_HOST_LEN = 253  # a DNS name's


def is_host_port(text: str) -> bool:
    """``text`` is HOST:PORT: a host name, an IPv4 address or a bracketed IPv6 address
    (``[::1]:50051``), then a TCP port of 1 to 65535 in ASCII digits (``str.isdigit`` takes
    '²' too). Nothing else: no scheme, no spaces or control characters, no unbracketed IPv6
    (``::1:1`` reads as another port)."""
    host, sep, port = text.rpartition(":")
    if not (sep and port.isascii() and port.isdigit() and 0 < int(port) < 65536):
        return False
    return is_host(host)


def is_host(host: str) -> bool:
    """A host name (DNS labels), an IPv4 address, or an IPv6 address in brackets."""
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            return False
        return True
    if not host.isascii() or len(host) > _MAX_HOST_LEN:
        return False
    return all(_LABEL.fullmatch(label) for label in host.removesuffix(".").split("."))


def join_host_port(host: str, port: int) -> str:
    """``host:port``, bracketing an IPv6 host."""
    if ":" in host and not host.startswith("["):
        return f"[{host}]:{port}"
    return f"{host}:{port}"
