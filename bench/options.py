"""Argument types the bench scripts share."""

from __future__ import annotations

import argparse

from pydantic import ValidationError

from collector.config import CollectorSettings, check_http_url, settings_error


def positive_int(text: str) -> int:
    """An argparse type: a count of at least 1 (rounds, steps, requests), refused at parse time rather than after
    minutes of set-up; argparse prints `argument --rounds: must be at least 1, got 0`."""
    value = int(text)  # a ValueError here: argparse prints "invalid positive_int value"
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """An argparse type: a count where 0 means none (`--overlapped-steps 0` skips them); below 0 is refused."""
    value = int(text)  # a ValueError here: argparse prints "invalid non_negative_int value"
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {value}")
    return value


def port(text: str) -> int:
    """An argparse type: a TCP port from 1 to 65535 (`--vllm-port`), refused at parse time rather than once the
    engine starts."""
    value = int(text)  # a ValueError here: argparse prints "invalid port value"
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port from 1 to 65535, got {value}")
    return value


def http_url(text: str) -> str:
    """An argparse type: a running service's address (`--trainer`, `--collector`), an http(s) URL with a host."""
    try:
        return check_http_url(text, "http://127.0.0.1:8000")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def database_url(text: str) -> str:
    """An argparse type: a database URL the collector takes for `--db` (parsed, its driver installed), checked as
    `art-collector serve` checks it, so a bad one is refused before the runs that come first."""
    try:
        CollectorSettings(db=text)
    except ValidationError as exc:
        raise argparse.ArgumentTypeError(settings_error(exc)) from exc
    return text
