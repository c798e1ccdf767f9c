"""Flattened, numbered span attributes → OpenAI-format messages and tools: pure functions, no I/O.

Instrumentations that cannot record a list in an attribute number its items in the attribute names:
OpenLLMetry's `gen_ai.prompt.N.role` / `.content` / `.tool_calls.M.*` and `gen_ai.completion.N.*` (a content of
parts written as the JSON text of the list, read back as the parts' text), and OpenInference's
`llm.input_messages.N.message.role` / `.content` / `.contents.M.message_content.text` /
`.tool_calls.M.tool_call.function.*`, `llm.output_messages...` and `llm.tools.N.tool.json_schema`. `unflatten`
turns the attributes under a prefix back into nested lists and objects; `flat_message`, `openinference_message`
and `openinference_tools` read one convention's items. A numbered level that skips a number (the SDK's attribute
count limit drops a long conversation's oldest attributes) misses an item: `unflatten` reads it as absent, with a
warning. A part of unexpected shape reads as absent too.

Also here, because both these readers and `collector.foreign` use them: `decoded` (a JSON-encoded value),
`parts_text` (the text of a list of content parts), `arguments_text` (tool-call arguments as JSON text) and `as_dict`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

from collector.spans import read_json, warn_once

__all__ = [
    "arguments_text",
    "as_dict",
    "decoded",
    "flat_message",
    "openinference_message",
    "openinference_tools",
    "parts_text",
    "unflatten",
]

log = logging.getLogger(__name__)

OPENINFERENCE_TOOLS = "llm.tools."
"""OpenInference: the tools offered, `llm.tools.N.tool.json_schema` (JSON text)."""


def decoded(value: Any) -> Any:
    """A JSON-encoded attribute value decoded; anything else (or text that is not JSON) as it is."""
    if not isinstance(value, str):
        return value
    try:
        return read_json(value)
    except ValueError:
        return value


def parts_text(parts: list[Any]) -> str:
    """Text of a list of content parts (`{"type": "text", "content"|"text": ...}` or plain strings)."""
    texts = []
    for part in parts:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, Mapping) and part.get("type", "text") == "text":
            texts.append(str(part.get("content", part.get("text", ""))))
    return "".join(texts)


def arguments_text(value: Any) -> str:
    """A tool call's arguments as JSON text: text as it is, any other value JSON-encoded."""
    return value if isinstance(value, str) else json.dumps(value)


def as_dict(value: Any) -> dict[str, Any]:
    """`value` when it is an object, else an empty one: a part of unexpected shape reads as absent."""
    return value if isinstance(value, dict) else {}


def unflatten(attributes: Mapping[str, Any], prefix: str, span_id: str) -> list[Any] | None:
    """`prefix.0.a.b = x` style attributes as a nested structure; numbered levels become lists.

    None, with a warning, when a numbered level skips a number (`prefix.0` and `prefix.2`, or no `prefix.0`): an item
    is missing, as when the SDK's attribute count limit (128 by default) dropped a long conversation's oldest ones.
    """
    tree: dict[str, Any] = {}
    for key, value in attributes.items():
        if not key.startswith(prefix):
            continue
        node = tree
        *path, leaf = key[len(prefix) :].split(".")
        for segment in path:
            child = node.setdefault(segment, {})
            if not isinstance(child, dict):
                break
            node = child
        else:
            node[leaf] = value
    if (missing := _missing_number(tree, prefix)) is not None:
        warn_once(log, "span %s: %s is missing (dropped by an attribute limit?); %s* read as absent", span_id, missing,
                  prefix)
        return None
    listed = _lists(tree)
    return listed if isinstance(listed, list) else []


def _numbered(node: Any) -> bool:
    """Whether `node` is a numbered level of `unflatten`'s tree (read as a list)."""
    # not isdigit: `int` refuses digits such as "²"
    return isinstance(node, dict) and bool(node) and all(key.isdecimal() for key in node)


def _missing_number(tree: dict[str, Any], prefix: str) -> str | None:
    """The attribute name of the first item a numbered level of `tree` skips, or None when none skips one."""
    pending = [(tree, prefix)]
    while pending:
        node, path = pending.pop()
        if _numbered(node):
            numbers = sorted(int(key) for key in node)
            if numbers != list(range(len(numbers))):
                return f"{path}{next(n for n, number in enumerate(numbers) if n != number)}"
        if isinstance(node, dict):
            pending.extend((child, f"{path}{key}.") for key, child in sorted(node.items(), reverse=True))
    return None


def _lists(node: Any) -> Any:
    if not isinstance(node, dict):
        return node
    if _numbered(node):
        return [_lists(node[key]) for key in sorted(node, key=int)]
    return {key: _lists(value) for key, value in node.items()}


def flat_message(node: Any, default_role: str = "user") -> dict[str, Any]:
    """One `gen_ai.prompt.N` / `gen_ai.completion.N` message (OpenLLMetry's flattened form)."""
    node = node if isinstance(node, dict) else {}
    message: dict[str, Any] = {"role": node.get("role", default_role), "content": _flat_content(node.get("content"))}
    calls = node.get("tool_calls")
    if isinstance(calls, list) and calls:
        message["tool_calls"] = [
            {
                "id": c.get("id"),
                "type": "function",
                "function": {"name": c.get("name"), "arguments": arguments_text(c.get("arguments", "{}"))},
            }
            for c in calls
            if isinstance(c, dict)
        ]
    if node.get("tool_call_id"):
        message["tool_call_id"] = node["tool_call_id"]
    return message


def _flat_content(value: Any) -> str:
    """A flattened message's content: OpenLLMetry writes a list of content parts as its JSON text, read as the
    parts' text."""
    if isinstance(value, str) and value.startswith("["):
        parts = decoded(value)
        if isinstance(parts, list) and parts and all(isinstance(p, Mapping) and "type" in p for p in parts):
            return parts_text(parts)
    return _text(value)


def _text(value: Any) -> str:
    """A flattened content attribute as text: an array is a list of parts, another value its JSON ("" for none)."""
    if value is None or isinstance(value, str):
        return value or ""
    return parts_text(value) if isinstance(value, list) else json.dumps(value)


def openinference_message(node: Any, default_role: str = "user") -> dict[str, Any]:
    """One `llm.*_messages.N.message` (OpenInference)."""
    body = as_dict(as_dict(node).get("message"))
    content = body.get("content")
    if content is None and isinstance(body.get("contents"), list):
        content = parts_text([c.get("message_content", {}) for c in body["contents"] if isinstance(c, dict)])
    message: dict[str, Any] = {"role": body.get("role", default_role), "content": _text(content)}
    calls = body.get("tool_calls")
    if isinstance(calls, list) and calls:
        message["tool_calls"] = []
        for call in calls:
            inner = as_dict(as_dict(call).get("tool_call"))
            function = as_dict(inner.get("function"))
            message["tool_calls"].append(
                {
                    "id": inner.get("id"),
                    "type": "function",
                    "function": {
                        "name": function.get("name"),
                        "arguments": arguments_text(function.get("arguments", "{}")),
                    },
                }
            )
    if body.get("tool_call_id"):
        message["tool_call_id"] = body["tool_call_id"]
    return message


def openinference_tools(attributes: Mapping[str, Any], span_id: str) -> list[dict[str, Any]]:
    """The tools an OpenInference span offered (`llm.tools.N.tool.json_schema`); a schema that is not JSON is left
    out, with a warning."""
    tools = []
    for node in unflatten(attributes, OPENINFERENCE_TOOLS, span_id) or []:
        schema = as_dict(as_dict(node).get("tool")).get("json_schema")
        if isinstance(schema, str):
            try:
                schema = read_json(schema)
            except ValueError as exc:
                warn_once(log, "span %s: OpenInference tool schema is not JSON (%s); ignored", span_id, exc)
                continue
        if isinstance(schema, dict):
            tools.append(schema)
    return tools
