"""host:port parsing and joining shared by the services and commands (rollserve.client.address)."""

from __future__ import annotations

import pytest
from rollserve.client.address import is_host_port, join_host_port


@pytest.mark.parametrize(
    "text",
    [
        "localhost:50051",
        "10.0.0.7:1",
        "[::1]:65535",
        "engine-3.svc.cluster.local:8000",
        "engine-3.svc.cluster.local.:8000",
        "node_7:1",
        "[fe80::2]:50051",
    ],
)
def test_host_port_is_read(text: str) -> None:
    assert is_host_port(text)


@pytest.mark.parametrize(
    "text",
    [
        "localhost",
        ":50051",
        "localhost:",
        "h:0",
        "h:65536",
        "h:5005²",
        "h:+1",
        "h: 1",
        # what RegisterEngine was sent and took before (a fuzzing run): none is a host
        "a\0b:1",
        "a b:1",
        "http://h:1",
        "unix:/tmp/x:1",
        "dns:///x.invalid:1",
        "ipv4:127.0.0.1:1,127.0.0.2:1",
        "::1:1",  # (gRPC dialled [::0.1.0.1]:443)
        "[not-v6]:1",
        "-h:1",
        "h..i:1",
        "é:1",
        "x" * 254 + ":1",
    ],
)
def test_what_is_not_host_port_is_refused(text: str) -> None:
    assert not is_host_port(text)


def test_an_ipv6_host_is_bracketed_once() -> None:
    assert join_host_port("::1", 7) == "[::1]:7"
    assert join_host_port("[::1]", 7) == "[::1]:7"
    assert join_host_port("0.0.0.0", 0) == "0.0.0.0:0"
    assert is_host_port(join_host_port("fe80::2", 50051))
