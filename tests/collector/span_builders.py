"""Builders of span records and OTLP requests for the collector tests."""

from __future__ import annotations

import base64
import json
from typing import Any

from google.protobuf import json_format
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.trace import SpanContext, TraceFlags

from art_langgraph import semconv as sc
from collector.otlp import SpanEvent, SpanRecord

TRACE = "0af7651916cd43dd8448eb211c80319c"


def sid(n: int) -> str:
    """A span id (16 hex digits) from a small number."""
    return f"{n:016x}"


def llm(
    n: int,
    *,
    rollout: str | None = "r1",
    trace: str = TRACE,
    start: int,
    prompt: list[int] | None,
    completion: list[int] | None,
    logprobs: list[float] | None = None,
    step: int | None = 0,
    task: str | None = None,
    messages: list[dict[str, Any]] | None = None,
    output: list[dict[str, Any]] | None = None,
    tools: list[dict[str, Any]] | None = None,
    model: str | None = None,
) -> SpanRecord:
    """An `llm` span; token attributes are left out when given as None."""
    attrs: dict[str, Any] = {sc.SPAN_KIND: sc.SPAN_KIND_LLM, sc.GEN_AI_OPERATION_NAME: "chat"}
    if rollout is not None:
        attrs[sc.ROLLOUT_ID] = rollout
    if prompt is not None:
        attrs[sc.PROMPT_TOKEN_IDS] = prompt
    if completion is not None:
        attrs[sc.COMPLETION_TOKEN_IDS] = completion
        attrs[sc.COMPLETION_LOGPROBS] = logprobs if logprobs is not None else [-0.5] * len(completion)
    if step is not None:
        attrs[sc.POLICY_STEP] = step
    if task is not None:
        attrs[sc.TASK] = task
    if messages is not None:
        attrs[sc.GEN_AI_INPUT_MESSAGES] = json.dumps(messages)
    if output is not None:
        attrs[sc.GEN_AI_OUTPUT_MESSAGES] = json.dumps(output)
    if tools is not None:
        attrs[sc.GEN_AI_TOOL_DEFINITIONS] = json.dumps(tools)
    if model is not None:
        attrs[sc.GEN_AI_RESPONSE_MODEL] = model
    return SpanRecord(trace, sid(n), sid(1000), "chat", start, start + 10, attrs)


def rollout(
    n: int,
    rollout_id: str = "r1",
    *,
    trace: str = TRACE,
    group: str | None = None,
    task: str | None = None,
    split: str = "train",
    size: int | None = None,
    rewards: dict[str, float] | None = None,
    metadata: dict[str, Any] | None = None,
) -> SpanRecord:
    """A `rollout` span with its reward events."""
    attrs: dict[str, Any] = {sc.SPAN_KIND: sc.SPAN_KIND_ROLLOUT, sc.ROLLOUT_ID: rollout_id, sc.SPLIT: split}
    for key, value in ((sc.GROUP, group), (sc.TASK, task), (sc.GROUP_SIZE, size)):
        if value is not None:
            attrs[key] = value
    if metadata is not None:
        attrs[sc.METADATA] = json.dumps(metadata)
    events = [
        SpanEvent(sc.REWARD_EVENT, 50, {sc.REWARD_NAME: name, sc.REWARD_VALUE: value})
        for name, value in (rewards or {}).items()
    ]
    return SpanRecord(trace, sid(n), None, "rollout", 0, 100, attrs, events)


def trajectory(
    n: int, rollout_id: str, *, reward: float | None, group: str = "g", size: int | None = 2, **kw: Any
) -> list[SpanRecord]:
    """A rollout span (ids n) and one LLM turn (ids n + 1) in a trace of its own."""
    trace = f"{n:032x}"
    rewards = {"reward": reward} if reward is not None else {}
    return [
        llm(n + 1, rollout=rollout_id, trace=trace, start=10, prompt=[1, 2], completion=[n], logprobs=[-1.0]),
        rollout(n, rollout_id, trace=trace, group=group, size=size, rewards=rewards, **kw),
    ]


def rollout_group(rollouts: dict[str, float], group: str = "g") -> list[SpanRecord]:
    """Spans of one group: per rollout id, a rollout span with its reward and one LLM turn."""
    spans = []
    for i, (rollout_id, reward) in enumerate(rollouts.items()):
        trace = f"{i + 1:032x}"
        spans.append(llm(10 * i + 1, rollout=rollout_id, trace=trace, start=5, prompt=[1], completion=[i + 2]))
        spans.append(rollout(10 * i + 2, rollout_id, trace=trace, group=group, size=len(rollouts),
                             rewards={"reward": reward}))
    return spans


def _context(trace_id: str, span_id: str) -> SpanContext:
    return SpanContext(int(trace_id, 16), int(span_id, 16), is_remote=False, trace_flags=TraceFlags(TraceFlags.SAMPLED))


def to_request(records: list[SpanRecord], resource: dict[str, Any] | None = None) -> ExportTraceServiceRequest:
    """An OTLP export request holding `records`, encoded by the OpenTelemetry SDK's exporter (as an app sends it).

    Attribute values go to the encoder as they are, unchecked: mixed-type arrays, NaN, out-of-range counts.
    """
    sdk_resource = Resource(resource or {})  # not Resource.create: no SDK default attributes
    spans = [
        ReadableSpan(
            name=r.name,
            context=_context(r.trace_id, r.span_id),
            parent=_context(r.trace_id, r.parent_span_id) if r.parent_span_id else None,
            resource=sdk_resource,
            attributes=r.attributes,
            events=[Event(e.name, e.attributes, e.time_ns) for e in r.events],
            start_time=r.start_ns,
            end_time=r.end_ns,
        )
        for r in records
    ]
    return encode_spans(spans)


def to_otlp_json(records: list[SpanRecord], resource: dict[str, Any] | None = None) -> bytes:
    """OTLP/JSON of `records`: camelCase keys, hex ids and enums as numbers, as the OTLP spec writes them."""
    data = json_format.MessageToDict(to_request(records, resource), use_integers_for_enums=True)
    for resource_spans in data["resourceSpans"]:
        for scope_spans in resource_spans["scopeSpans"]:
            for span in scope_spans["spans"]:
                for key in ("traceId", "spanId", "parentSpanId"):
                    if key in span:
                        span[key] = base64.b64decode(span[key]).hex()
    return json.dumps(data).encode()
