"""Decode OTLP/HTTP trace exports (`POST /v1/traces`) into plain span records.

Both OTLP encodings are accepted: binary protobuf (`application/x-protobuf`) and OTLP/JSON
(`application/json`), optionally gzip-compressed. OTLP/JSON differs from protobuf's canonical
JSON mapping in one way that matters here: trace and span ids are hex strings, not base64.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import zlib
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from google.protobuf import json_format
from google.protobuf.descriptor import Descriptor
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Status

__all__ = [
    "CONTENT_TYPE_JSON",
    "CONTENT_TYPE_PROTOBUF",
    "Decoded",
    "OtlpError",
    "SpanEvent",
    "SpanRecord",
    "decode_request",
    "encode_response",
    "gunzip",
]

CONTENT_TYPE_PROTOBUF = "application/x-protobuf"
CONTENT_TYPE_JSON = "application/json"


class OtlpError(ValueError):
    """An export body that cannot be decoded. `code` is the HTTP error code to answer with."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class SpanEvent:
    """One span event: a name, a time and attributes."""

    name: str
    time_ns: int
    attributes: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SpanRecord:
    """One span, decoded: ids as lowercase hex, attribute arrays as lists."""

    trace_id: str
    span_id: str
    parent_span_id: str | None
    name: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any] = field(default_factory=dict)
    events: list[SpanEvent] = field(default_factory=list)
    resource: dict[str, Any] = field(default_factory=dict)
    failed: bool = False
    """The span's status is ERROR: how instrumentations that set no `error.type` (OpenInference) mark a failed call."""

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict (the inverse of `from_dict`); it shares the attribute dicts.

        Built by hand: `dataclasses.asdict` deep-copies every token id list, which cost more
        than the rest of the ingest path together.
        """
        return {
            "trace_id": self.trace_id,
            "span_id": self.span_id,
            "parent_span_id": self.parent_span_id,
            "name": self.name,
            "start_ns": self.start_ns,
            "end_ns": self.end_ns,
            "attributes": self.attributes,
            "events": [{"name": e.name, "time_ns": e.time_ns, "attributes": e.attributes} for e in self.events],
            "resource": self.resource,
            **({"failed": True} if self.failed else {}),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SpanRecord:
        """Rebuild a record from `to_dict` output."""
        events = [SpanEvent(**event) for event in data.get("events", [])]
        return cls(**{**data, "events": events})


@dataclass(frozen=True)
class Decoded:
    """A decoded export: the spans to store and, per rejected span, why it was rejected."""

    spans: list[SpanRecord]
    rejected: list[str] = field(default_factory=list)


_GZIP_FEED = 4096
"""Compressed bytes given to zlib at a time: where a gzip member ends, zlib copies the input left over
(`unused_data`), so feeding a whole body of many members would copy it once per member."""


def gunzip(body: bytes, max_bytes: int) -> bytes:
    """Decompress a gzip body, every member of it (RFC 1952: a gzip file is a series of members, as
    `cat a.gz b.gz` makes), refusing output larger than `max_bytes`.

    Raises:
        OtlpError: `malformed_body` when the body is not gzip (data after a member included),
            `body_too_large` past the limit.
    """
    data, view, offset = bytearray(), memoryview(body), 0
    while True:
        decompressor = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
        while not decompressor.eof and offset < len(view):
            chunk = view[offset : offset + _GZIP_FEED]
            try:
                data += decompressor.decompress(chunk, max_bytes + 1 - len(data))
            except zlib.error as exc:
                message = f"Content-Encoding is gzip but the body is not valid gzip: {exc}"
                raise OtlpError("malformed_body", message) from exc
            if len(data) > max_bytes:
                raise OtlpError("body_too_large", f"decompressed body exceeds {max_bytes} bytes")
            offset += len(chunk) - len(decompressor.unused_data)
        if not decompressor.eof:
            raise OtlpError("malformed_body", "Content-Encoding is gzip but the gzip stream is truncated")
        if offset == len(view):
            return bytes(data)


def media_type(content_type: str | None) -> str:
    """The media type of a Content-Type header, lowercased, without parameters."""
    return (content_type or "").split(";", 1)[0].strip().lower()


def decode_request(body: bytes, content_type: str | None) -> Decoded:
    """Decode an (already decompressed) export body into span records.

    A span with an invalid trace or span id is rejected alone (an OTLP partial success), not
    the whole export.

    Raises:
        OtlpError: `unsupported_media_type` for a content type other than protobuf or JSON,
            `malformed_body` naming what is malformed otherwise.
    """
    kind = media_type(content_type)
    if kind == CONTENT_TYPE_PROTOBUF:
        request = ExportTraceServiceRequest()
        try:
            request.ParseFromString(body)
        except DecodeError as exc:
            raise OtlpError(
                "malformed_body", f"body is not a valid protobuf ExportTraceServiceRequest: {exc}"
            ) from exc
    elif kind == CONTENT_TYPE_JSON:
        request, rejected = _parse_json(body)
        decoded = _records(request)
        return Decoded(decoded.spans, rejected + decoded.rejected)
    else:
        raise OtlpError(
            "unsupported_media_type",
            f"Content-Type {content_type!r} is not supported; send {CONTENT_TYPE_PROTOBUF} or {CONTENT_TYPE_JSON}",
        )
    return _records(request)


def encode_response(content_type: str | None, rejected: list[str] | None = None) -> tuple[bytes, str]:
    """An ExportTraceServiceResponse in the request's encoding: empty on full success, else a
    `partial_success` with the number of rejected spans and the first reasons."""
    response = ExportTraceServiceResponse()
    if rejected:
        shown = "; ".join(rejected[:5]) + (f"; and {len(rejected) - 5} more" if len(rejected) > 5 else "")
        response.partial_success.rejected_spans = len(rejected)
        response.partial_success.error_message = f"{len(rejected)} spans rejected: {shown}"
    if media_type(content_type) == CONTENT_TYPE_JSON:
        return json_format.MessageToJson(response).encode(), CONTENT_TYPE_JSON
    return response.SerializeToString(), CONTENT_TYPE_PROTOBUF


def _parse_json(body: bytes) -> tuple[ExportTraceServiceRequest, list[str]]:
    """Parse OTLP/JSON (UTF-8), converting its hex ids to the base64 that `json_format` expects.

    Returns the request without the spans whose ids are not hex strings, and why each was left out. Like
    `json_format` (and the OpenTelemetry Collector), it reads a field under its proto name (`trace_id`) too.
    """
    try:
        text = body.decode("utf-8-sig")  # strict: `json.loads` of bytes would let encoded surrogates through
        data = json.loads(text)
    except ValueError as exc:  # also not UTF-8, and an integer past Python's 4300 digits
        raise OtlpError("malformed_body", f"body is not valid JSON: {exc}") from exc
    except RecursionError as exc:
        raise OtlpError("malformed_body", "body is JSON nested too deeply") from exc
    if not isinstance(data, dict):
        raise OtlpError("malformed_body", "OTLP/JSON body must be an object with `resourceSpans`")
    rejected: list[str] = []
    for r, resource_spans in enumerate(_list(data, "resourceSpans", "")):
        for s, scope_spans in enumerate(_list(resource_spans, "scopeSpans", f"resourceSpans[{r}]")):
            kept = []
            for i, span in enumerate(_list(scope_spans, "spans", f"resourceSpans[{r}].scopeSpans[{s}]")):
                path = f"resourceSpans[{r}].scopeSpans[{s}].spans[{i}]"
                problem = _hex_ids_to_base64(span, path, ("traceId", "spanId", "parentSpanId"))
                for k, link in enumerate(_list(span, "links", path)):
                    problem = problem or _hex_ids_to_base64(link, f"{path}.links[{k}]", ("traceId", "spanId"))
                if problem:
                    rejected.append(problem)
                else:
                    kept.append(span)
            scope_spans["spans"] = kept
    request = ExportTraceServiceRequest()
    try:
        if _SURROGATE_ESCAPE.search(text):
            _refuse_lone_surrogates(data)
        _require_objects(data, request.DESCRIPTOR, "")
        json_format.ParseDict(data, request, ignore_unknown_fields=True)
    except json_format.ParseError as exc:
        raise OtlpError("malformed_body", f"body is not a valid OTLP/JSON ExportTraceServiceRequest: {exc}") from exc
    except OverflowError as exc:  # `json_format` lets it out: 400 digits for a double, 1e400 for an enum
        raise OtlpError(
            "malformed_body", f"body is not a valid OTLP/JSON ExportTraceServiceRequest: a number out of range ({exc})"
        ) from exc
    except RecursionError as exc:
        raise OtlpError("malformed_body", "body is JSON nested too deeply") from exc
    return request, rejected


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
"""A JSON escape of a UTF-16 surrogate: two in a row make one character, one alone is no text (protobuf fails on it
deep inside, with a `SystemError` or an error message that cannot be encoded)."""


def _refuse_lone_surrogates(data: Any) -> None:
    """Refuse parsed JSON in which a string holds a surrogate that no second one paired into a character.

    Raises:
        OtlpError: `malformed_body`, naming the surrogate.
    """
    try:
        json.dumps(data, ensure_ascii=False).encode()
    except UnicodeEncodeError as exc:
        lone = exc.object[exc.start : exc.end]
        raise OtlpError("malformed_body", f"body holds a lone UTF-16 surrogate {lone!r}: not valid Unicode") from exc


@cache
def _message_fields(descriptor: Descriptor) -> tuple[tuple[str, str, Descriptor, bool], ...]:
    """(JSON name, name, message type, repeated) of each field of `descriptor` whose type is a message."""
    return tuple((f.json_name, f.name, f.message_type, f.is_repeated) for f in descriptor.fields if f.message_type)


def _require_objects(value: Any, descriptor: Descriptor, path: str) -> None:
    """Check that every message in parsed OTLP/JSON is an object (or null): `json_format`, told to ignore unknown
    fields, reads a string there as an empty message (its characters as unknown field names), so a plain
    `"value": "r1"` would be stored as no value at all.

    Raises:
        OtlpError: `malformed_body`, naming the first place where something else stands.
    """
    if not isinstance(value, dict):
        raise OtlpError("malformed_body", f"{path or 'body'} must be an object, not {str(value)[:40]!r}")
    for json_name, name, message, repeated in _message_fields(descriptor):
        key = json_name if json_name in value else name
        child = value.get(key)
        if child is None:
            continue
        if not repeated:
            _require_objects(child, message, f"{path}.{key}" if path else key)
        elif isinstance(child, list):  # anything else `json_format` refuses, naming it
            for i, item in enumerate(child):
                if item is not None:  # a null element `json_format` refuses, naming it
                    _require_objects(item, message, f"{path}.{key}[{i}]" if path else f"{key}[{i}]")


_PROTO_NAMES = {
    "resourceSpans": "resource_spans",
    "scopeSpans": "scope_spans",
    "traceId": "trace_id",
    "spanId": "span_id",
    "parentSpanId": "parent_span_id",
}
"""The proto names of the OTLP/JSON fields `_parse_json` reads itself, where they differ from the JSON names."""


def _key(obj: dict[str, Any], json_name: str, path: str) -> str:
    """The key under which `obj` holds a field: its JSON name, or its proto name when `obj` has that one.

    Raises:
        OtlpError: `malformed_body` when `obj` has both (`json_format` reads the last, so the other's ids would be
            read as base64).
    """
    name = _PROTO_NAMES.get(json_name, json_name)
    if name not in obj:
        return json_name
    if name != json_name and json_name in obj:
        raise OtlpError("malformed_body", f"{path or 'body'} holds both {json_name} and {name}; send one")
    return name


def _list(parent: Any, key: str, path: str) -> list[Any]:
    """`parent[key]` (or under the key's proto name) as a list (missing or null → empty, as protobuf's JSON mapping
    reads null); anything else is malformed."""
    if not isinstance(parent, dict):
        raise OtlpError("malformed_body", f"{path or 'body'} must be an object")
    key = _key(parent, key, path)
    value = parent.get(key)
    if value is None:
        return []
    if not isinstance(value, list):
        raise OtlpError("malformed_body", f"{(path + '.') if path else ''}{key} must be an array")
    return value


def _hex_ids_to_base64(obj: dict[str, Any], path: str, keys: tuple[str, ...]) -> str | None:
    """Replace hex id strings in `obj` (under the JSON names `keys`, or their proto names) by base64, in place; say
    why not when one is no hex string.

    Raises:
        OtlpError: `malformed_body` when `obj` is not an object, or holds an id under both its names.
    """
    if not isinstance(obj, dict):
        raise OtlpError("malformed_body", f"{path} must be an object")
    for json_name in keys:
        key = _key(obj, json_name, path)
        value = obj.get(key)
        if value is None or value == "":
            continue
        try:
            raw = bytes.fromhex(value) if isinstance(value, str) else None
        except ValueError:
            raw = None
        if raw is None:
            return f"{path}.{key} is not a hex string: {str(value)[:40]!r}"
        obj[key] = base64.b64encode(raw).decode()
    return None


def _records(request: ExportTraceServiceRequest) -> Decoded:
    """Flatten a decoded request into span records, rejecting spans with invalid ids."""
    records: list[SpanRecord] = []
    rejected: list[str] = []
    for resource_spans in request.resource_spans:
        resource = _attributes(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                problem = (
                    _id_problem(span.trace_id, 16, "trace_id", span.name)
                    or _id_problem(span.span_id, 8, "span_id", span.name)
                    or (
                        _id_problem(span.parent_span_id, 8, "parent_span_id", span.name)
                        if span.parent_span_id
                        else None
                    )
                )
                if problem:
                    rejected.append(problem)
                    continue
                records.append(
                    SpanRecord(
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_span_id=span.parent_span_id.hex() or None,
                        name=span.name,
                        start_ns=span.start_time_unix_nano,
                        end_ns=span.end_time_unix_nano,
                        attributes=_attributes(span.attributes),
                        events=[
                            SpanEvent(event.name, event.time_unix_nano, _attributes(event.attributes))
                            for event in span.events
                        ],
                        resource=resource,
                        failed=span.status.code == Status.STATUS_CODE_ERROR,
                    )
                )
    return Decoded(records, rejected)


def _id_problem(raw: bytes, size: int, what: str, span_name: str) -> str | None:
    """Why an id is invalid (wrong length or all zeros), or None."""
    if len(raw) != size or not any(raw):
        return (
            f"span {span_name!r} has an invalid {what} ({len(raw)} bytes, {binascii.hexlify(raw).decode()!r}); "
            f"expected {size} bytes, not all zero"
        )
    return None


def _attributes(pairs: Any) -> dict[str, Any]:
    """OTLP KeyValue list → plain dict."""
    return {pair.key: _value(pair.value) for pair in pairs if isinstance(pair, KeyValue)}


def _value(value: AnyValue) -> Any:
    """OTLP AnyValue → plain Python (arrays → lists, kvlists → dicts, bytes → hex)."""
    kind = value.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return _array(value.array_value.values)
    if kind == "kvlist_value":
        return _attributes(value.kvlist_value.values)
    if kind == "bytes_value":
        return value.bytes_value.hex()
    return getattr(value, kind)


def _array(values: Any) -> list[Any]:
    """An OTLP array → list, with a fast path for the long ones (token ids, logprobs).

    An array whose first element is an int (or a double) is read as ints (doubles) in one
    pass; an element of another kind reads as 0 there, so only the zeros need their kind
    checked before the fast result is trusted. Anything else goes element by element.
    """
    if not values:
        return []
    kind = values[0].WhichOneof("value")
    if kind == "int_value":
        fast: list[Any] = [item.int_value for item in values]
    elif kind == "double_value":
        fast = [item.double_value for item in values]
    else:
        return [_value(item) for item in values]
    if 0 not in fast or all(values[i].WhichOneof("value") == kind for i, x in enumerate(fast) if x == 0):
        return fast
    return [_value(item) for item in values]
