"""The API-key check both services apply to `Authorization` headers (the collector's writes, the trainer's routes),
and how both read the key from the environment (`ART_API_KEY` only)."""

from __future__ import annotations

import hmac
import os

__all__ = ["bearer_matches", "configured_key", "refuse_key_name"]


def bearer_matches(authorization: str, key: str) -> bool:
    """True when an `Authorization` header says `Bearer <key>`: the scheme in any case (RFC 7235), the key
    compared in constant time."""
    scheme, _, token = authorization.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())


def configured_key(value: object) -> object:
    """`ART_API_KEY` as both services read it (a settings validator): surrounding whitespace dropped, as HTTP drops it
    from the `Authorization` header that carries the key, and a blank key counts as unset.

    Raises:
        ValueError: a key that is not ASCII, which no HTTP client sends in a header (every request would be 401), or
            that holds a control character (a line break, DEL; a tab is one HTTP allows in a header value), which
            requests refuses to send in a header and uvicorn to read (every export, or every request, would fail).
    """
    if not isinstance(value, str):
        return value
    key = value.strip() or None
    if key is not None and not key.isascii():
        raise ValueError("ART_API_KEY must be ASCII: HTTP clients send header values as ASCII, so no request could "
                         "carry this key and every one would be refused")
    if key is not None and (control := next((char for char in key if not char.isprintable() and char != "\t"), None)):
        raise ValueError(f"ART_API_KEY holds the control character {control!r}, which no HTTP header may carry: "
                         "every request with this key would fail. Remove it from the key")
    return key


def refuse_key_name(name: str) -> None:
    """Refuse the variable `name` (a service's prefix + `API_KEY`) set in any case (a settings validator): with
    `populate_by_name`, pydantic-settings reads the key under its field name too, in any case, a second name of
    `ART_API_KEY` that the plugin never sends.

    Raises:
        ValueError: such a variable is set; the message names it as spelled.
    """
    for variable in sorted(os.environ):
        if variable.upper() == name.upper():
            raise ValueError(f"{variable} is not read: the API key is ART_API_KEY, the one the plugin sends to the "
                             f"trainer and the collector. Set ART_API_KEY and unset {variable}.")
