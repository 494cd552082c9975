"""host:port addresses, as every rollserve service and command reads and writes them."""

from __future__ import annotations


def is_host_port(text: str) -> bool:
    """``text`` is HOST:PORT: a host, then a TCP port of 1 to 65535 in ASCII digits
    (``str.isdigit`` takes '²' too). An IPv6 host is bracketed: ``[::1]:50051``."""
    host, sep, port = text.rpartition(":")
    return bool(sep and host) and port.isascii() and port.isdigit() and 0 < int(port) < 65536


def join_host_port(host: str, port: int) -> str:
    """``host:port``, bracketing an IPv6 host."""
    if ":" in host and not host.startswith("["):
        return f"[{host}]:{port}"
    return f"{host}:{port}"
