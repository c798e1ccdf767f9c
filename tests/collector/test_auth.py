"""Tests of the API-key check and of how the services read `ART_API_KEY` (`collector/auth.py`)."""

from __future__ import annotations

import re

import pytest

from collector.auth import bearer_matches, configured_key


@pytest.mark.parametrize("key", ["a\nb", "a\rb", "a\x00b", "a\x01b", "a\x7fb", "a\x1bb"])
def test_a_key_holding_a_control_character_is_refused(key: str) -> None:
    """Only ASCII was checked: `a\\nb` passed, and requests (the plugin's exporter) refuses such a header, uvicorn's
    parser `\\x01` and `\\x7f` too: every export, or every request to the service, failed."""
    with pytest.raises(ValueError, match=f"ART_API_KEY holds the control character {re.escape(repr(key[1]))}"):
        configured_key(key)


@pytest.mark.parametrize(("value", "key"), [(" k3y\n", "k3y"), ("a b", "a b"), ("~!#", "~!#"), ("\t ", None),
                                            ("a\tb", "a\tb")])  # HTTP allows a tab in a header value
def test_a_printable_key_is_kept_without_its_surrounding_whitespace(value: str, key: str | None) -> None:
    assert configured_key(value) == key
    if key is not None:
        assert bearer_matches(f"Bearer {key}", key)
