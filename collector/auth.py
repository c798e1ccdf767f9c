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
    from the `Authorization` header that carries the key, and a blank key counts as unset."""
    return (value.strip() or None) if isinstance(value, str) else value
