"""The API-key check both services apply to `Authorization` headers (the collector's writes, the trainer's routes)."""

from __future__ import annotations

import hmac

__all__ = ["bearer_matches", "configured_key"]


def bearer_matches(authorization: str, key: str) -> bool:
    """True when an `Authorization` header says `Bearer <key>`: the scheme in any case (RFC 7235), the key
    compared in constant time."""
    scheme, _, token = authorization.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())


def configured_key(value: object) -> object:
    """`ART_API_KEY` as both services read it (a settings validator): surrounding whitespace dropped, as HTTP drops it
    from the `Authorization` header that carries the key, and a blank key counts as unset.

    Raises:
        ValueError: a key that is not ASCII, which no HTTP client sends in a header (every request would be 401).
    """
    if not isinstance(value, str):
        return value
    key = value.strip() or None
    if key is not None and not key.isascii():
        raise ValueError("ART_API_KEY must be ASCII: HTTP clients send header values as ASCII, so no request could "
                         "carry this key and every one would be refused")
    return key
