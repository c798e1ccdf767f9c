"""OTLP decoding: protobuf and JSON give the same records; malformed input names the fault."""

from __future__ import annotations

import gzip
import json

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

from collector.otlp import OtlpError, SpanEvent, SpanRecord, decode_request, encode_response, gunzip
from tests.collector.span_builders import TRACE, llm, rollout, sid, to_otlp_json, to_request

PB = "application/x-protobuf"
JSON = "application/json"


def _records() -> list[SpanRecord]:
    return [
        llm(1, start=5, prompt=[1, 2, 3], completion=[4, 5], logprobs=[-0.25, -1.5],
            messages=[{"role": "user", "content": "hi"}]),
        rollout(2, group="g", size=4, rewards={"reward": 0.75, "len": 3.0}),
    ]


def test_protobuf_decodes_every_field() -> None:
    body = to_request(_records(), resource={"service.name": "agent"}).SerializeToString()
    first, second = decode_request(body, PB).spans
    assert first.trace_id == TRACE and first.span_id == sid(1) and first.parent_span_id == sid(1000)
    assert (first.start_ns, first.end_ns, first.name) == (5, 15, "chat")
    assert first.attributes["art.prompt_token_ids"] == [1, 2, 3]
    assert first.attributes["art.completion_logprobs"] == [-0.25, -1.5]
    assert first.resource == {"service.name": "agent"}
    assert second.parent_span_id is None
    assert second.events == [
        SpanEvent("art.reward", 50, {"art.reward.name": "reward", "art.reward.value": 0.75}),
        SpanEvent("art.reward", 50, {"art.reward.name": "len", "art.reward.value": 3.0}),
    ]


def test_json_with_hex_ids_equals_protobuf() -> None:
    records = _records()
    from_json = decode_request(to_otlp_json(records), "application/json; charset=utf-8").spans
    from_pb = decode_request(to_request(records).SerializeToString(), PB).spans
    assert from_json == from_pb
    assert [(r.trace_id, r.span_id) for r in from_json] == [(TRACE, sid(1)), (TRACE, sid(2))]


def test_json_accepts_int_values_as_numbers_and_unknown_fields() -> None:
    body = {
        "resourceSpans": [{"scopeSpans": [{"spans": [{
            "traceId": TRACE, "spanId": sid(7), "name": "x", "startTimeUnixNano": 1, "endTimeUnixNano": "2",
            "kind": 1, "futureField": True,
            "attributes": [{"key": "n", "value": {"intValue": 3}}, {"key": "b", "value": {"bytesValue": "AAE="}}],
        }]}]}]
    }
    (span,) = decode_request(json.dumps(body).encode(), JSON).spans
    assert span.attributes == {"n": 3, "b": "0001"}
    assert (span.start_ns, span.end_ns) == (1, 2)


def test_json_null_lists_read_as_empty() -> None:
    """Protobuf's JSON mapping reads null as the field's default: such bodies were refused with 400."""
    span = {"traceId": TRACE, "spanId": sid(7), "name": "x", "links": None, "events": None, "attributes": None}
    body = {"resourceSpans": [{"scopeSpans": None}, {"scopeSpans": [{"spans": None}, {"spans": [span]}]}]}
    (record,) = decode_request(json.dumps(body).encode(), JSON).spans
    assert (record.name, record.attributes, record.events) == ("x", {}, [])
    assert decode_request(b'{"resourceSpans": null}', JSON).spans == []


@pytest.mark.parametrize(
    "value",
    [[3, 0, 7], [0.5, 0.0, -1.25, -0.0], [1, "a", 2.5, True, 0], [0, 0], [2.5, 1, 0], ["x", 1], [True, 0], [],
     [1.5, 2.0]],
)
def test_arrays_decode_exactly(value: list[object]) -> None:
    """Long int/double arrays take a fast path; mixed arrays and zeros must still decode exactly."""
    record = SpanRecord(TRACE, sid(1), None, "x", 1, 2, {"a": value})
    (span,) = decode_request(to_request([record]).SerializeToString(), PB).spans
    got = span.attributes["a"]
    assert got == value and [type(v) for v in got] == [type(v) for v in value]


def test_records_round_trip_through_dict() -> None:
    for record in _records():
        assert SpanRecord.from_dict(json.loads(json.dumps(record.to_dict()))) == record


def _span_json(**fields: object) -> bytes:
    """OTLP/JSON of one span with `fields` (json.dumps escapes a lone surrogate as `\\ud800`)."""
    span = {"traceId": TRACE, "spanId": sid(1), "name": "x", **fields}
    return json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [span]}]}]}).encode()


def test_json_ids_under_proto_field_names_read_as_hex() -> None:
    """Protobuf's JSON mapping, and the OpenTelemetry Collector, read a field's proto name (`trace_id`) as well as its
    JSON name: ids under it were read as base64, the span rejected for ids never sent, or stored under them."""
    spans = [{"trace_id": TRACE, "span_id": sid(1), "parent_span_id": sid(9), "name": "ok",
              "links": [{"trace_id": TRACE, "span_id": sid(3)}]},
             {"trace_id": "a" * 22, "span_id": sid(2), "name": "short"},  # 11 bytes as hex, 16 as base64
             {"traceId": TRACE, "span_id": "zz", "name": "zz"}]
    body = json.dumps({"resource_spans": [{"scope_spans": [{"spans": spans}]}]}).encode()
    decoded = decode_request(body, JSON)
    assert [(s.trace_id, s.span_id, s.parent_span_id) for s in decoded.spans] == [(TRACE, sid(1), sid(9))]
    assert decoded.rejected == [
        "resourceSpans[0].scopeSpans[0].spans[2].span_id is not a hex string: 'zz'",
        f"span 'short' has an invalid trace_id (11 bytes, {'a' * 22!r}); expected 16 bytes, not all zero",
    ]


def test_json_surrogate_pairs_and_bom_decode() -> None:
    (span,) = decode_request(b"\xef\xbb\xbf" + _span_json(name="\U0001f600"), JSON).spans
    assert span.name == "\U0001f600"


@pytest.mark.parametrize(
    ("body", "content_type", "fragment"),
    [
        (b"\xff\xff\xff", PB, "not a valid protobuf ExportTraceServiceRequest"),
        (b"{not json", JSON, "not valid JSON"),
        (b"[1, 2]", JSON, "must be an object"),
        (b'{"resourceSpans": {}}', JSON, "resourceSpans must be an array"),
        (b"[" * 100_000 + b"]" * 100_000, JSON, "nested too deeply"),
        # an integer past Python's 4300 digits is a ValueError, not a JSONDecodeError: it was a 500
        (_span_json(startTimeUnixNano="N").replace(b'"N"', b"1" * 5000), JSON, "not valid JSON: Exceeds the limit"),
        (json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": TRACE, "spanId": sid(1),
                                                                   "startTimeUnixNano": "x"}]}]}]}).encode(),
         JSON, "not a valid OTLP/JSON"),
        # numbers past a float's range where protobuf wants a double or an enum: an OverflowError, a 500
        (_span_json(attributes=[{"key": "a", "value": {"doubleValue": "N"}}]).replace(b'"N"', b"9" * 400), JSON,
         "not a valid OTLP/JSON ExportTraceServiceRequest: a number out of range"),
        (_span_json(kind="N").replace(b'"N"', b"1e400"), JSON,
         "not a valid OTLP/JSON ExportTraceServiceRequest: a number out of range"),
        # a field under both its names: protobuf reads the last, the hex of the other was read as base64
        (_span_json(trace_id=TRACE), JSON, "resourceSpans[0].scopeSpans[0].spans[0] holds both traceId and trace_id"),
        (b'{"resourceSpans": [], "resource_spans": []}', JSON, "body holds both resourceSpans and resource_spans"),
        (b'{"resourceSpans": [{"scopeSpans": [{"spans": [1]}]}]}', JSON,
         "resourceSpans[0].scopeSpans[0].spans[0] must be an object"),
        (json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": TRACE, "spanId": sid(1),
                                                                   "links": [[]]}]}]}]}).encode(),
         JSON, "resourceSpans[0].scopeSpans[0].spans[0].links[0] must be an object"),
        # a string where a message belongs was read as an empty one: the value, the status, the event lost
        (_span_json(attributes=[{"key": "art.rollout.id", "value": "r1"}]), JSON,
         "spans[0].attributes[0].value must be an object, not 'r1'"),
        (_span_json(status="ERROR"), JSON, "spans[0].status must be an object, not 'ERROR'"),
        (_span_json(events=["art.reward"]), JSON, "spans[0].events[0] must be an object"),
        (_span_json(attributes=[{"key": "ids", "value": {"arrayValue": {"values": ["1"]}}}]), JSON,
         "spans[0].attributes[0].value.arrayValue.values[0] must be an object"),
        # lone UTF-16 surrogates failed deep in protobuf: a SystemError, or an error message no response could encode
        (_span_json(attributes=["\ud800"]), JSON, "lone UTF-16 surrogate '\\ud800'"),
        (_span_json(attributes="\udc00"), JSON, "lone UTF-16 surrogate '\\udc00'"),
        (_span_json(name="\ud800").replace(b"\\ud800", b"\xed\xa0\x80"), JSON, "not valid JSON"),
    ],
)
def test_malformed_bodies_name_the_fault(body: bytes, content_type: str, fragment: str) -> None:
    with pytest.raises(OtlpError) as info:
        decode_request(body, content_type)
    assert info.value.code == "malformed_body"
    assert fragment in str(info.value)


def test_spans_with_invalid_ids_are_rejected_alone() -> None:
    good = {"traceId": TRACE, "spanId": sid(1), "name": "ok"}
    spans = [good, {"traceId": TRACE, "spanId": "abcd", "name": "s"},
             {"traceId": "00" * 16, "spanId": sid(2), "name": "z"},
             {"traceId": "zz", "spanId": sid(3), "name": "x"}, {"traceId": TRACE, "spanId": sid(4), "parentSpanId": 7},
             {"traceId": TRACE, "spanId": sid(5), "links": [{"traceId": TRACE, "spanId": "not hex"}]}]
    decoded = decode_request(json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": spans}]}]}).encode(), JSON)
    assert [s.name for s in decoded.spans] == ["ok"]
    assert decoded.rejected == [
        "resourceSpans[0].scopeSpans[0].spans[3].traceId is not a hex string: 'zz'",
        "resourceSpans[0].scopeSpans[0].spans[4].parentSpanId is not a hex string: '7'",
        "resourceSpans[0].scopeSpans[0].spans[5].links[0].spanId is not a hex string: 'not hex'",
        "span 's' has an invalid span_id (2 bytes, 'abcd'); expected 8 bytes, not all zero",
        "span 'z' has an invalid trace_id (16 bytes, '00000000000000000000000000000000'); "
        "expected 16 bytes, not all zero",
    ]


def test_unsupported_content_type() -> None:
    with pytest.raises(OtlpError) as info:
        decode_request(b"", "text/plain")
    assert info.value.code == "unsupported_media_type"


def test_empty_protobuf_body_is_an_empty_export() -> None:
    assert decode_request(b"", PB).spans == []


def test_gunzip_limits_and_errors() -> None:
    payload = b"x" * 5000
    assert gunzip(gzip.compress(payload), 5000) == payload
    with pytest.raises(OtlpError) as too_big:
        gunzip(gzip.compress(payload), 4999)
    assert too_big.value.code == "body_too_large"
    with pytest.raises(OtlpError, match="not valid gzip"):
        gunzip(b"plain", 100)
    with pytest.raises(OtlpError, match="truncated"):
        gunzip(gzip.compress(payload)[:20], 10_000)


def test_gunzip_reads_every_member() -> None:
    """A gzip body is a series of members (`cat a.gz b.gz`): the spans of the second one were dropped, answered 200."""
    assert gunzip(gzip.compress(b"abc") + gzip.compress(b"") + gzip.compress(b"def"), 6) == b"abcdef"
    stored = bytes(range(256)) * 75  # level 0: a member of 19 kB, several zlib feeds long
    assert gunzip(gzip.compress(stored, 0) + gzip.compress(b"x") + gzip.compress(stored, 0), 50_000) == (
        stored + b"x" + stored
    )
    with pytest.raises(OtlpError) as too_big:
        gunzip(gzip.compress(b"abc") + gzip.compress(b"defg"), 6)
    assert too_big.value.code == "body_too_large"
    with pytest.raises(OtlpError, match="not valid gzip"):
        gunzip(gzip.compress(b"abc") + b"junk", 100)
    with pytest.raises(OtlpError, match="truncated"):
        gunzip(gzip.compress(b"abc") + gzip.compress(b"def")[:12], 100)


def test_response_follows_request_encoding() -> None:
    body, media = encode_response(PB)
    assert media == PB and ExportTraceServiceResponse.FromString(body) == ExportTraceServiceResponse()
    body, media = encode_response("application/json")
    assert media == JSON and json.loads(body) == {}


def test_partial_success_counts_and_explains() -> None:
    reasons = [f"reason {i}" for i in range(7)]
    body, _ = encode_response(PB, reasons)
    partial = ExportTraceServiceResponse.FromString(body).partial_success
    assert partial.rejected_spans == 7
    assert partial.error_message == "7 spans rejected: reason 0; reason 1; reason 2; reason 3; reason 4; and 2 more"
    body, _ = encode_response(JSON, reasons[:1])
    assert json.loads(body) == {"partialSuccess": {"rejectedSpans": "1", "errorMessage": "1 spans rejected: reason 0"}}
