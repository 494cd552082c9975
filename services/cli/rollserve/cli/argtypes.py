"""argparse ``type=`` checks shared by the commands: a bad value is refused with the rule."""

from __future__ import annotations

import argparse

from rollserve.client.address import is_host_port


def positive_int(text: str) -> int:
    """An integer of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def non_negative_int(text: str) -> int:
    """An integer of at least 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} must be at least 0")
    return value


def positive_float(text: str) -> float:
    """A number greater than 0."""
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{value} must be greater than 0")
    return value


def port_number(text: str) -> int:
    """A TCP port to listen on, 1 to 65535."""
    value = int(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port (1 to 65535)")
    return value


def host_port(text: str) -> str:
    """HOST:PORT, a port of 1 to 65535."""
    if not is_host_port(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT (a port of 1 to 65535)")
    return text
