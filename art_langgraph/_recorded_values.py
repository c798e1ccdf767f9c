"""Checks of what a rollout records (task, group and split names, rewards, metadata), each refused at once where the
collector would reject it or could not keep it apart from another."""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Mapping
from decimal import Decimal
from typing import Any

from art_langgraph import semconv


def _check_name(value: str, what: str, limit: int = semconv.MAX_NAME_LENGTH) -> None:
    """Refuse a name the collector would reject with its whole span: not a string, longer than `limit`, with a NUL;
    or one it could not keep apart from others: with a surrogate (bytes decoded with `surrogateescape`), which UTF-8
    cannot encode, so export sends it as U+FFFD (and `POST /v1/rewards` could not send it at all)."""
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a string, got {type(value).__name__}")
    if len(value) > limit or "\x00" in value:
        raise ValueError(
            f"{what} must be at most {limit} characters, without NUL; got {value[:40]!r} ({len(value)} characters)"
        )
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"{what} must be text UTF-8 can encode: {value[:40]!r} holds the surrogate "
            f"{value[exc.start]!r} (sent as U+FFFD, names that differ only there would be one)"
        ) from None


def _check_reward(value: float, name: str) -> float:
    """`value` as a float: any real number (NumPy's too), not a bool, finite; `name` non-empty and storable."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"reward {name!r} must be a number, got {type(value).__name__}")
    try:
        value = float(value)
    except OverflowError:  # an int (or Fraction) beyond float's range
        raise ValueError(f"reward {name!r} must be finite, got a number beyond float's range") from None
    if not math.isfinite(value):
        raise ValueError(f"reward {name!r} must be finite, got {value}")
    _check_name(name, "reward name")
    if not name:
        raise ValueError("reward name must be a non-empty string")
    return value


def _metadata_json(metadata: Mapping[str, Any] | None) -> str | None:
    """`metadata` as the JSON the rollout span carries (a value JSON has no type for becomes its `str`); None if empty.

    Text is kept as it is, not escaped: a lone surrogate (bytes decoded with `surrogateescape`) stays one, so export
    sends it as U+FFFD as in every other attribute. Escaped (`"\\udcff"`), it passed export and reached the collector
    as a lone surrogate again once parsed, where no answer holding the trajectory could be encoded.

    Raises:
        TypeError: `metadata` is not a mapping, or has a key JSON cannot take (a NumPy number other than a `float64`, a
            `Decimal`, a tuple: no `str`, `int`, `float`, bool or None), named with where it is.
        ValueError: JSON cannot take it (a circular reference, a NaN or infinity as a value or a key, a float's,
            NumPy's or a `Decimal`'s: `NaN` is no JSON, which the collector read as null), named with where it is.
    """
    if metadata is None:
        return None
    if not isinstance(metadata, Mapping):
        raise TypeError(f"rollout metadata must be a dict, got {type(metadata).__name__}")
    metadata = dict(metadata)  # json writes a mapping that is no dict as its `str`, which the collector ignored
    try:
        return json.dumps(metadata, default=_json_default, ensure_ascii=False, allow_nan=False) if metadata else None
    except (TypeError, ValueError) as exc:
        if (problem := _unencodable(metadata, "rollout metadata")) is not None:
            raise problem from None
        raise type(exc)(f"rollout metadata cannot be exported as JSON: {exc}") from exc


def _json_default(value: Any) -> Any:
    """A value JSON has no type for: a mapping that is no dict as an object (its `str` said nothing of its items, or
    was `<M object at 0x...>`), anything else as its `str`; refused if it is a NaN or infinity (a NumPy scalar, a
    `Decimal`), whose `str` (`'nan'`) would pass for text where a float's NaN is refused."""
    if isinstance(value, Mapping):
        return dict(value)
    if not _finite(value):
        raise ValueError(f"JSON has no NaN or infinity, got {value}")
    return str(value)


def _finite(value: Any) -> bool:
    """False for a NaN or an infinity: a float, a NumPy floating scalar (any real number that is not rational) or a
    `Decimal` (a signalling NaN too); True for any other value. Compared, not converted to float: a NumPy `longdouble`
    beyond float's range is finite."""
    if isinstance(value, Decimal):
        return value.is_finite()
    return not isinstance(value, numbers.Real) or isinstance(value, numbers.Rational) or -math.inf < value < math.inf


def _unencodable(value: Any, where: str, inside: frozenset[int] = frozenset()) -> TypeError | ValueError | None:
    """The error for the first thing in `value` that JSON cannot take, in the order encoding meets them (a key before
    its value), naming where it is and what to give instead: a key of a type JSON has no key for (`TypeError`,
    `['a'] has the key Decimal('1.5') (Decimal), ...`), a NaN or infinity (`ValueError`, `['a'][0] is nan: ...`,
    `['a'] has the key nan: ...`); None without one. A container met again inside itself (a circular reference) is not
    entered twice."""
    if not _finite(value):
        return ValueError(
            f"{where} is {value}: JSON has no NaN or infinity (the collector would read it as null); give "
            "a finite number, None or a string"
        )
    if id(value) in inside:
        return None
    items = value.items() if isinstance(value, Mapping) else enumerate(value) if isinstance(value, list | tuple) else ()
    for key, item in items:
        if isinstance(value, Mapping) and not (key is None or isinstance(key, str | int | float)):  # json's key types
            return TypeError(
                f"{where} has the key {key!r:.60} ({type(key).__name__}), which JSON cannot take as a key: "
                "give a str (str(key)), an int, a float, a bool or None"
            )
        if isinstance(value, Mapping) and not _finite(key):
            return ValueError(
                f"{where} has the key {key}: JSON has no NaN or infinity; give a string or a finite number as key"
            )
        if (found := _unencodable(item, f"{where}[{key!r}]", inside | {id(value)})) is not None:
            return found
    return None
