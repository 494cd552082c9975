"""The scheduler's command line: its flags reach the settings, and values out of range are
refused before it starts, naming the setting. No edge is faked (no server is started)."""

from __future__ import annotations

import pytest
from rollserve.scheduler.server import build_parser, main, settings_from_args

REDIS = ["--redis-url", "redis://127.0.0.1:1/0"]


def test_health_flags_reach_the_settings() -> None:
    args = build_parser().parse_args(
        [*REDIS, "--health-interval-s", "0.5", "--health-timeout-s", "30", "--health-failures", "4"]
    )
    settings = settings_from_args(args)
    assert (settings.health_interval_s, settings.health_timeout_s, settings.health_failures) == (
        0.5,
        30.0,
        4,
    )
    default = settings_from_args(build_parser().parse_args(REDIS))
    assert (default.health_timeout_s, default.health_failures) == (2.0, 2)


@pytest.mark.parametrize(
    ("flag", "value", "setting"),
    [
        ("--health-timeout-s", "0", "health_timeout_s"),
        ("--health-timeout-s", "61", "health_timeout_s"),
        ("--health-failures", "0", "health_failures"),
        ("--health-failures", "101", "health_failures"),
    ],
)
def test_health_flags_out_of_range_are_refused_naming_the_setting(
    flag: str, value: str, setting: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*REDIS, flag, value]) == 2
    assert setting in capsys.readouterr().err


def test_stream_flags_reach_the_settings() -> None:
    default = settings_from_args(build_parser().parse_args(REDIS))
    assert (default.trim_acked, default.acked_retention_s, default.stream_maxlen) == (
        True,
        300.0,
        0,
    )
    args = build_parser().parse_args(
        [*REDIS, "--keep-acked-entries", "--acked-retention-s", "60", "--stream-maxlen", "1000"]
    )
    settings = settings_from_args(args)
    assert (settings.trim_acked, settings.acked_retention_s, settings.stream_maxlen) == (
        False,
        60.0,
        1000,
    )


def test_a_negative_retention_is_refused_naming_the_setting(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main([*REDIS, "--acked-retention-s", "-1"]) == 2
    assert "acked_retention_s" in capsys.readouterr().err
