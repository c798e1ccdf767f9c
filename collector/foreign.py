"""Messages of a model-call span, whatever instrumentation wrote it.

`art_langgraph` writes OpenAI-format JSON in `gen_ai.input.messages` / `gen_ai.output.messages`.
Other GenAI instrumentations are read too, so their traces become (not token-exact)
trajectories that the trainer re-tokenizes:

* OpenTelemetry GenAI semantic conventions: `gen_ai.input.messages` / `gen_ai.output.messages`
  in the structured form (`{"role", "parts": [{"type": "text", "content"}, ...]}`) with
  `gen_ai.system_instructions`, and the older flattened form `gen_ai.prompt.N.role` /
  `gen_ai.prompt.N.content` / `gen_ai.completion.N.*` (as OpenLLMetry writes it: a content of parts as the
  JSON text of the list, read back as the parts' text).
* OpenInference: `openinference.span.kind = LLM`, `llm.input_messages.N.message.role` /
  `.content` / `.contents.M.message_content.text` / `.tool_calls.M.tool_call.function.*`,
  `llm.output_messages...`, `llm.model_name`, `llm.tools.N.tool.json_schema`.
* Langfuse SDK (OpenTelemetry based): `langfuse.observation.type = generation`, with
  `langfuse.observation.input` / `.output` (JSON, or plain text) and
  `langfuse.observation.model.name`.

Every result is in OpenAI chat format (`role`, `content`, `tool_calls`, `tool_call_id`). A span that carries
messages in more than one convention is read from the first of them, in the order above, that holds any (a warning
says when another holds different ones). A flattened conversation (OpenLLMetry's, OpenInference's) that skips a
number, such as `gen_ai.prompt.0` and `gen_ai.prompt.2` without `gen_ai.prompt.1`, misses a message (the SDK's
attribute count limit drops a long conversation's oldest attributes): it reads as absent, with a warning. A call
whose mark that limit dropped (`llm.request.type`, `openinference.span.kind`, set first) is still a model call by its
reply (`gen_ai.completion.0.role`, `llm.output_messages.0.message.role`, set last). The numbered items of the
flattened conventions are read in `collector.flattened_messages`; this module picks the convention and reads the rest.

`finish_reason` reads why a call's first reply ended wherever its convention records it:
`gen_ai.response.finish_reasons`, the `finish_reason` of each structured `gen_ai.output.messages` entry,
OpenLLMetry's `gen_ai.completion.N.finish_reason` and OpenInference's `llm.finish_reason`. The Langfuse SDK
records none.

`describes_art_call` recognises a foreign span of a call that `art_langgraph.ARTChatModel`
made (and so recorded exactly in its own `llm` span): the LangChain run metadata these
instrumentations copy onto their spans holds `art.traced = true` (`semconv.TRACED_RUN`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from art_langgraph import semconv as sc
from collector.flattened_messages import (
    arguments_text,
    as_dict,
    decoded,
    flat_message,
    openinference_message,
    openinference_tools,
    parts_text,
    unflatten,
)
from collector.spans import read_json, warn_once

__all__ = ["Conversation", "conversation", "describes_art_call", "finish_reason", "is_generation", "same_messages"]

log = logging.getLogger(__name__)

GEN_AI_SYSTEM_INSTRUCTIONS = "gen_ai.system_instructions"
GEN_AI_PROMPT = "gen_ai.prompt."
GEN_AI_COMPLETION = "gen_ai.completion."
OPENLLMETRY_REQUEST_TYPE = "llm.request.type"
OPENLLMETRY_FUNCTIONS = "llm.request.functions."
OPENINFERENCE_SPAN_KIND = "openinference.span.kind"
OPENINFERENCE_INPUT = "llm.input_messages."
OPENINFERENCE_OUTPUT = "llm.output_messages."
OPENINFERENCE_MODEL = "llm.model_name"
OPENINFERENCE_METADATA = "metadata"
"""OpenInference: JSON object of the LangChain run's metadata."""
OPENINFERENCE_FINISH_REASON = "llm.finish_reason"
"""OpenInference: why the model stopped (`SpanAttributes.LLM_FINISH_REASON`, e.g. `stop` or `length`)."""
LANGFUSE_TYPE = "langfuse.observation.type"
LANGFUSE_INPUT = "langfuse.observation.input"
LANGFUSE_OUTPUT = "langfuse.observation.output"
LANGFUSE_MODEL = "langfuse.observation.model.name"
LANGFUSE_METADATA = "langfuse.observation.metadata."
"""Langfuse: one attribute per metadata key, its value JSON-encoded."""

_GEN_AI_OPERATIONS = ("chat", "text_completion", "generate_content")
"""A tuple, not a set: an attribute may hold an array or kvlist, which cannot be hashed."""


@dataclass(frozen=True)
class Conversation:
    """One model call: the messages sent, the messages returned, the tools offered, the model."""

    input: list[dict[str, Any]] = field(default_factory=list)
    output: list[dict[str, Any]] = field(default_factory=list)
    tools: list[dict[str, Any]] = field(default_factory=list)
    model: str | None = None


def is_generation(attributes: Mapping[str, Any]) -> bool:
    """True for a model call in any supported convention (without `art.span.kind`)."""
    return (
        attributes.get(sc.GEN_AI_OPERATION_NAME) in _GEN_AI_OPERATIONS
        or attributes.get(OPENINFERENCE_SPAN_KIND) == "LLM"
        or attributes.get(LANGFUSE_TYPE) == "generation"
        or attributes.get(OPENLLMETRY_REQUEST_TYPE) in ("chat", "completion")
        or f"{GEN_AI_PROMPT}0.role" in attributes
        # a reply, set last: the SDK's attribute count limit drops a long call's oldest attributes, its mark among them
        or f"{GEN_AI_COMPLETION}0.role" in attributes
        or (OPENINFERENCE_SPAN_KIND not in attributes and f"{OPENINFERENCE_OUTPUT}0.message.role" in attributes)
    )


def describes_art_call(attributes: Mapping[str, Any]) -> bool:
    """True for another instrumentation's span of an `ARTChatModel` call (run metadata `art.traced = true`)."""
    marked = decoded(attributes.get(f"{LANGFUSE_METADATA}{sc.TRACED_RUN}"))
    if marked is True:
        return True
    metadata = decoded(attributes.get(OPENINFERENCE_METADATA))
    return isinstance(metadata, Mapping) and metadata.get(sc.TRACED_RUN) is True


def conversation(attributes: Mapping[str, Any], *, span_id: str = "?") -> Conversation:
    """The conversation a model-call span carries; empty lists where it carries none (or one missing a message)."""
    model = next(
        (
            attributes[key]
            for key in (sc.GEN_AI_RESPONSE_MODEL, sc.GEN_AI_REQUEST_MODEL, OPENINFERENCE_MODEL, LANGFUSE_MODEL)
            if isinstance(attributes.get(key), str) and attributes[key]
        ),
        None,
    )
    tools = _gen_ai_tools(attributes, span_id) or openinference_tools(attributes, span_id)
    read = [(name, found) for name, reader in _CONVENTIONS if (found := reader(attributes, span_id)) is not None]
    if not read:
        return Conversation(tools=tools, model=model)
    name, (sent, returned, offered) = next(((n, found) for n, found in read if found[0] or found[1]), read[0])
    for other, (other_sent, other_returned, _) in read:
        if other != name and (other_sent or other_returned) and not (
            same_messages(other_sent, sent) and same_messages(other_returned, returned)
        ):
            warn_once(log, "span %s: its %s messages differ from its %s ones, which are read", span_id, other, name)
    return Conversation(sent, returned, tools or offered, model)


def finish_reason(attributes: Mapping[str, Any]) -> str | None:
    """Why a model call's first reply ended, lower-case (`stop`, `length`, ...); None where the span does not say.

    Read from the first of `gen_ai.response.finish_reasons`, else the first `gen_ai.output.messages` entry's
    `finish_reason` (required by the GenAI output-messages schema), OpenLLMetry's `gen_ai.completion.0.finish_reason`
    (its `_set_completions`), OpenInference's `llm.finish_reason`. Instrumentations that pass the provider's own
    value on (OpenLLMetry's Anthropic one) say `max_tokens` for a reply the token limit cut, as Anthropic, Bedrock
    and Gemini (`MAX_TOKENS`) do: read as `length`.
    """
    reason = next((value.lower() for value in _finish_reasons(attributes) if isinstance(value, str) and value), None)
    return "length" if reason == "max_tokens" else reason


def _finish_reasons(attributes: Mapping[str, Any]) -> Iterator[object]:
    """The places `finish_reason` reads, in its order, each read only when the ones before said nothing (the output
    messages are JSON to decode)."""
    reasons = attributes.get(sc.GEN_AI_RESPONSE_FINISH_REASONS)
    yield reasons[0] if isinstance(reasons, list) and reasons else reasons
    output = decoded(attributes.get(sc.GEN_AI_OUTPUT_MESSAGES))
    yield as_dict(output[0]).get("finish_reason") if isinstance(output, list) and output else None
    yield attributes.get(f"{GEN_AI_COMPLETION}0.finish_reason")
    yield attributes.get(OPENINFERENCE_FINISH_REASON)


def same_messages(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    """Whether two message lists say the same (role, text, tool calls, tool call id), ignoring extras."""
    return len(a) == len(b) and all(_essence(x) == _essence(y) for x, y in zip(a, b, strict=True))


# --- conventions -----------------------------------------------------------------------------

_Messages = tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]
"""What a convention's reader returns: the messages sent, the messages returned, the tools the messages offered."""


def _read_gen_ai(attributes: Mapping[str, Any], span_id: str) -> _Messages | None:
    """`gen_ai.input.messages` / `gen_ai.output.messages` (structured or OpenAI format); None where absent."""
    if sc.GEN_AI_INPUT_MESSAGES not in attributes and sc.GEN_AI_OUTPUT_MESSAGES not in attributes:
        return None
    system = _json(attributes, GEN_AI_SYSTEM_INSTRUCTIONS, span_id)
    sent = _semconv_messages(_json(attributes, sc.GEN_AI_INPUT_MESSAGES, span_id), span_id)
    if isinstance(system, list) and not any(m.get("role") == "system" for m in sent):
        sent = [{"role": "system", "content": parts_text(system)}, *sent]
    return sent, _semconv_messages(_json(attributes, sc.GEN_AI_OUTPUT_MESSAGES, span_id), span_id), []


def _read_numbered(
    attributes: Mapping[str, Any], span_id: str, prefixes: tuple[str, str], read: Callable[..., dict[str, Any]]
) -> _Messages | None:
    """The messages numbered under `prefixes` (sent, returned), each read by `read`; None where absent, nothing where
    a message is missing (`unflatten`)."""
    if not any(key.startswith(prefixes) for key in attributes):
        return None
    prompt, completion = (unflatten(attributes, prefix, span_id) for prefix in prefixes)
    if prompt is None or completion is None:
        return [], [], []
    return [read(node) for node in prompt], [read(node, "assistant") for node in completion], []


def _read_flattened(attributes: Mapping[str, Any], span_id: str) -> _Messages | None:
    """`gen_ai.prompt.N.*` / `gen_ai.completion.N.*` (`_read_numbered`)."""
    return _read_numbered(attributes, span_id, (GEN_AI_PROMPT, GEN_AI_COMPLETION), flat_message)


def _read_openinference(attributes: Mapping[str, Any], span_id: str) -> _Messages | None:
    """`llm.input_messages.N.message.*` / `llm.output_messages.N.message.*` (`_read_numbered`)."""
    return _read_numbered(attributes, span_id, (OPENINFERENCE_INPUT, OPENINFERENCE_OUTPUT), openinference_message)


def _read_langfuse(attributes: Mapping[str, Any], span_id: str) -> _Messages | None:
    """`langfuse.observation.input` / `.output`; None where absent."""
    if LANGFUSE_INPUT not in attributes and LANGFUSE_OUTPUT not in attributes:
        return None
    sent, offered = _langfuse_messages(attributes.get(LANGFUSE_INPUT), "user", span_id)
    returned, _ = _langfuse_messages(attributes.get(LANGFUSE_OUTPUT), "assistant", span_id)
    return sent, returned, offered


_CONVENTIONS = (
    ("OpenTelemetry GenAI gen_ai.input/output.messages", _read_gen_ai),
    ("flattened gen_ai.prompt/completion", _read_flattened),
    ("OpenInference", _read_openinference),
    ("Langfuse", _read_langfuse),
)
"""Each convention's reader, in the order `conversation` tries them."""


# --- helpers ---------------------------------------------------------------------------------


def _essence(message: Mapping[str, Any]) -> tuple[Any, ...]:
    content = message.get("content")
    text = parts_text(content) if isinstance(content, list) else (content or "")
    calls = []
    for call in message.get("tool_calls") or []:
        function = call.get("function", call) if isinstance(call, Mapping) else {}
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = read_json(arguments)
            except ValueError:
                pass
        calls.append((function.get("name"), json.dumps(arguments, sort_keys=True)))
    return message.get("role"), str(text).strip(), tuple(calls), message.get("tool_call_id")


def _json(attributes: Mapping[str, Any], key: str, span_id: str) -> Any:
    raw = attributes.get(key)
    if not isinstance(raw, str):
        return raw
    try:
        return read_json(raw)
    except ValueError as exc:
        warn_once(log, "span %s: attribute %s is not valid JSON (%s); ignored", span_id, key, exc)
        return None


def _openai_message(message: Mapping[str, Any], span_id: str) -> dict[str, Any]:
    """An OpenAI-format message as recorded, less the tool calls that are not `{"function": {...}}` objects."""
    out = dict(message)
    calls = out.get("tool_calls")
    if calls is None:
        return out
    listed = calls if isinstance(calls, list) else [calls]
    out["tool_calls"] = [
        call for call in listed if isinstance(call, Mapping) and isinstance(call.get("function"), Mapping)
    ]
    if len(out["tool_calls"]) < len(listed):
        warn_once(log, "span %s: %d of a message's tool calls are not OpenAI tool calls; left out",
                  span_id, len(listed) - len(out["tool_calls"]))
    return out


def _semconv_messages(value: Any, span_id: str) -> list[dict[str, Any]]:
    """`gen_ai.*.messages`: OpenAI-format messages pass through; `parts` messages are converted."""
    if not isinstance(value, list):
        return []
    out: list[dict[str, Any]] = []
    for message in value:
        if not isinstance(message, Mapping):
            continue
        if "parts" not in message:
            out.append(_openai_message(message, span_id))
            continue
        role = message.get("role", "user")
        parts = message["parts"] if isinstance(message["parts"], list) else []
        calls = [p for p in parts if isinstance(p, Mapping) and p.get("type") == "tool_call"]
        responses = [p for p in parts if isinstance(p, Mapping) and p.get("type") == "tool_call_response"]
        for response in responses:
            result = response.get("response", response.get("result"))
            content = result if isinstance(result, str) else json.dumps(result)
            out.append({"role": "tool", "tool_call_id": response.get("id"), "content": content})
        text = parts_text(parts)
        if text or calls or not responses:
            converted: dict[str, Any] = {"role": role, "content": text}
            if calls:
                converted["tool_calls"] = [
                    {
                        "id": c.get("id"),
                        "type": "function",
                        "function": {"name": c.get("name"), "arguments": arguments_text(c.get("arguments", {}))},
                    }
                    for c in calls
                ]
            out.append(converted)
    return out


def _langfuse_messages(raw: Any, role: str, span_id: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Langfuse input/output → (messages, tools). JSON lists of messages, `{"messages": ...}`, or text."""
    if raw is None:
        return [], []
    value = raw
    if isinstance(raw, str):
        try:
            value = read_json(raw)
        except ValueError:
            return [{"role": role, "content": raw}], []
    tools: list[dict[str, Any]] = []
    if isinstance(value, Mapping) and isinstance(value.get("messages"), list):
        offered = value.get("tools")
        tools = [t for t in offered if isinstance(t, dict)] if isinstance(offered, list) else []
        value = value["messages"]
    if isinstance(value, Mapping) and "role" in value:
        value = [value]
    if isinstance(value, list) and all(isinstance(m, Mapping) and "role" in m for m in value):
        return _semconv_messages(value, span_id), tools
    content = value if isinstance(value, str) else json.dumps(value)
    return [{"role": role, "content": content}], tools


def _gen_ai_tools(attributes: Mapping[str, Any], span_id: str) -> list[dict[str, Any]]:
    value = _json(attributes, sc.GEN_AI_TOOL_DEFINITIONS, span_id)
    if isinstance(value, list):
        return [tool for tool in value if isinstance(tool, dict)]
    functions = unflatten(attributes, OPENLLMETRY_FUNCTIONS, span_id) or []
    tools = []
    for function in functions:
        if isinstance(function, dict) and function.get("name"):
            parameters = function.get("parameters")
            if isinstance(parameters, str):
                try:
                    parameters = read_json(parameters)
                except ValueError:
                    parameters = {}
            spec = {
                "name": function["name"],
                "description": function.get("description", ""),
                "parameters": parameters or {},
            }
            tools.append({"type": "function", "function": spec})
    return tools
