"""Argument types the bench scripts share."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """An argparse type: a count of at least 1 (rounds, steps, requests), refused at parse time rather than after
    minutes of set-up; argparse prints `argument --rounds: must be at least 1, got 0`."""
    value = int(text)  # a ValueError here: argparse prints "invalid positive_int value"
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value
