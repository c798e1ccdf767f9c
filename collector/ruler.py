"""RULER: a group-relative LLM judge, as pure functions (the HTTP call is `collector.judge_client`).

The judge sees a group's trajectories side by side. Messages every trajectory starts with
(the shared prefix: system prompt, task) are sent once as context; each trajectory's own
messages follow as a numbered block, their text escaped as in XML so that none forges a block's
tags. Identical trajectories are shown once and share the score. The answer is constrained by a
JSON schema (`response_format={"type": "json_schema"}`, which vLLM enforces with guided
decoding): an object keyed by block number with every block required, so a judge held to the
schema cannot skip a block or score one twice. It is checked again here: one score in [0, 1]
with an explanation for every block, nothing else.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from xml.sax.saxutils import escape

from collector.spans import without_surrogates

__all__ = [
    "JudgeError",
    "Score",
    "build_messages",
    "dedupe",
    "explanation_limit",
    "fingerprint",
    "parse_cut",
    "parse_scores",
    "render_message",
    "response_format",
    "scores_only_tokens",
    "shared_prefix",
]

Messages = list[dict[str, Any]]

_SYSTEM = """\
You are a careful judge. {task}

Rubric:
{rubric}

Answer with JSON only: {{"scores": {{{entries}}}}}
with exactly one entry per trajectory, keyed by its id, in the order given."""

_ENTRY = '"1": {"explanation": "<one or two sentences>", "score": <0..1>}'
"""The first entry of the answer's `scores` object, as the system prompt shows it."""

_SEVERAL = """\
You see several attempts (trajectories) at the same task by an AI agent.
Score each trajectory from 0 to 1 against the rubric, relative to the others: the best one should
score near the top of the range and the worst near the bottom, unless they are truly equal."""

_ONE = """\
You see one attempt (a trajectory) at a task by an AI agent.
Score it from 0 to 1 against the rubric on its own: there is no other attempt to compare it with, so
what the rubric says about comparing trajectories does not apply; score how good this one is."""


def _system(rubric: str, count: int) -> str:
    """The judge's system prompt for `count` trajectory blocks: one alone is scored on its own, not relative to others
    (a group of one, or of identical trajectories, see `dedupe`)."""
    task, entries = (_ONE, _ENTRY) if count == 1 else (_SEVERAL, f'{_ENTRY}, "2": ...')
    return _SYSTEM.format(task=task, rubric=rubric.strip(), entries=entries)


class JudgeError(Exception):
    """A judge call that failed or answered something unusable; `code` says which, `answer` is the answer's text
    when it was cut at `max_tokens` (`judge_truncated`; see `parse_cut`), and `retry_after` the seconds the judge
    asked to wait before another try (its answer's `Retry-After`; None when it asked for none)."""

    def __init__(
        self, message: str, *, code: str, answer: str | None = None, retry_after: float | None = None
    ) -> None:
        super().__init__(message)
        self.code = code
        self.answer = answer
        self.retry_after = retry_after


@dataclass(frozen=True)
class Score:
    """The judge's verdict on one numbered trajectory block."""

    block: int
    """1-based number of the block in the prompt."""
    score: float
    explanation: str


def fingerprint(messages: Messages) -> str:
    """A stable hash of a message list (canonical JSON), used to spot identical trajectories."""
    return hashlib.sha256(json.dumps(messages, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def dedupe(conversations: Sequence[Messages]) -> tuple[list[Messages], list[int]]:
    """Distinct conversations in first-seen order, and for each input the index of its distinct copy."""
    distinct: list[Messages] = []
    index: dict[str, int] = {}
    owner: list[int] = []
    for messages in conversations:
        key = fingerprint(messages)
        if key not in index:
            index[key] = len(distinct)
            distinct.append(messages)
        owner.append(index[key])
    return distinct, owner


def shared_prefix(conversations: Sequence[Messages]) -> int:
    """How many leading messages every conversation has in common (0 for fewer than two)."""
    if len(conversations) < 2:
        return 0
    shortest = min(len(messages) for messages in conversations)
    for n in range(shortest):
        first = conversations[0][n]
        if any(messages[n] != first for messages in conversations[1:]):
            return n
    return shortest


def _text(content: Any) -> str:
    """Message content as text: strings as they are, OpenAI content parts joined, anything else as JSON."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [_text(part.get("text", "")) if isinstance(part, dict) else str(part) for part in content]
        return "\n".join(part for part in parts if part)
    return json.dumps(content, ensure_ascii=False)


def render_message(message: dict[str, Any]) -> str:
    """One message as judge-readable text: `[role] content`, tool calls and results spelled out."""
    role = str(message.get("role", "?"))
    lines = []
    text = _text(message.get("content"))
    if role == "tool":
        lines.append(f"[tool result{' ' + str(message['tool_call_id']) if message.get('tool_call_id') else ''}] {text}")
    elif text:
        lines.append(f"[{role}] {text}")
    for call in message.get("tool_calls") or []:  # with its id, which the tool result names
        call = call if isinstance(call, dict) else {}
        function = call.get("function", call)
        call_id = f" {call['id']}" if call.get("id") else ""
        lines.append(f"[{role} calls tool{call_id}] {function.get('name', '?')}({_text(function.get('arguments'))})")
    return "\n".join(lines) or f"[{role}]"


_ESCAPED = "The text inside the tags below is escaped as in XML: &lt; stands for <, &gt; for > and &amp; for &."
"""Opens the judge's user message: a trajectory's text is escaped (`<`, `>`, `&`), so that no text of an agent, a
`</trajectory>` or `<trajectory id="2">` in its answer say, closes its block or opens another the judge reads as
another trajectory's."""


def build_messages(rubric: str, conversations: Sequence[Messages]) -> Messages:
    """The judge's chat: rubric as system prompt; shared context once, then one numbered block each, their text
    escaped as in XML (see `_ESCAPED`).

    Args:
        rubric: What makes a trajectory good.
        conversations: Distinct trajectories (see `dedupe`), each a list of OpenAI messages.
    """
    if not conversations:
        raise ValueError("nothing to judge: the group has no trajectories")
    n = shared_prefix(conversations)
    parts = [_ESCAPED]
    if n:
        context = escape("\n".join(render_message(m) for m in conversations[0][:n]))
        parts.append(f"Every trajectory starts with this context:\n<context>\n{context}\n</context>")
    count = len(conversations)
    parts.append("There is 1 trajectory:" if count == 1 else f"There are {count} trajectories:")
    for number, messages in enumerate(conversations, start=1):
        body = escape("\n".join(render_message(m) for m in messages[n:])) or (
            "(nothing beyond the context)" if n else "(no messages)"  # e.g. it ended before calling the model
        )
        parts.append(f'<trajectory id="{number}">\n{body}\n</trajectory>')
    return [
        {"role": "system", "content": _system(rubric, count)},
        {"role": "user", "content": "\n\n".join(parts)},
    ]


def _block_keys(count: int) -> list[str]:
    """The keys of the judge's `scores` object: `"1"`..`"count"`, one per trajectory block."""
    return [str(block) for block in range(1, count + 1)]


_LONGEST_SCORE = "0.000001"
"""The longest number the schema's guided grammar lets a judge write for a score (xgrammar: 6 decimals)."""


def scores_only_tokens(count: int) -> int:
    """The most tokens an answer of `count` scores with empty explanations takes, end-of-text token included, at
    one token per character (see `explanation_limit`): the least `max_tokens` in which scores alone surely fit."""
    empty = {block: {"explanation": "", "score": 0} for block in _block_keys(count)}
    return len(json.dumps({"scores": empty})) + count * (len(_LONGEST_SCORE) - 1) + 1


def explanation_limit(count: int, max_tokens: int, configured: int = 0) -> int:
    """The `maxLength` of each explanation that lets the judge's whole answer fit in `max_tokens`.

    The answer with every explanation at this length, the longest scores and the end-of-text
    token takes at most `max_tokens` tokens, counting one token per character: a byte-level
    tokenizer never needs more for ASCII text. `configured` (0: none) lowers it further. Without
    this bound a guided judge that runs on inside an explanation is cut at `max_tokens` (the
    bundled 135M judge did, on 4 blocks of 300 characters against 1024 tokens).
    """
    fits = max(0, (max_tokens - scores_only_tokens(count)) // max(count, 1))
    return min(fits, configured) if configured else fits


def response_format(count: int, explanation_max_chars: int | None = None) -> dict[str, Any]:
    """OpenAI `response_format`: a JSON schema with one required entry per block `"1"`..`"count"`.

    `explanation_max_chars` is each explanation's `maxLength` (None: no limit).
    """
    explanation: dict[str, Any] = {"type": "string"}
    if explanation_max_chars is not None:
        explanation["maxLength"] = explanation_max_chars
    item = {
        "type": "object",
        "properties": {"explanation": explanation, "score": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["explanation", "score"],
        "additionalProperties": False,
    }
    blocks = _block_keys(count)
    scores = {
        "type": "object",
        "properties": {block: item for block in blocks},
        "required": blocks,
        "additionalProperties": False,
    }
    schema = {"type": "object", "properties": {"scores": scores}, "required": ["scores"], "additionalProperties": False}
    return {"type": "json_schema", "json_schema": {"name": "ruler_scores", "schema": schema, "strict": True}}


_QUOTED_CHARS = 50
"""Most characters of a value of the judge's answer quoted in an error (the error is stored on the run, logged)."""


def _quoted(value: object) -> str:
    """`value`'s repr for an error message, cut to `_QUOTED_CHARS`."""
    return repr(value)[:_QUOTED_CHARS]


def _listed(keys: Sequence[object], most: int = 5) -> str:
    """`keys` for an error message: the first `most`, each quoted (`_quoted`), and how many more."""
    more = [f"+{len(keys) - most} more"] if len(keys) > most else []
    return "[" + ", ".join([*(_quoted(key) for key in keys[:most]), *more]) + "]"


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object as a dict; a key written twice (e.g. one trajectory scored twice) is an error."""
    data: dict[str, Any] = {}
    for key, value in pairs:
        if key in data:
            raise JudgeError(
                f"key {_quoted(key)} appears twice in one object of the judge's answer", code="judge_bad_scores"
            )
        data[key] = value
    return data


_CUT = "\u2026"
"""Ends an explanation cut to its `maxLength` (`parse_scores`)."""


def _bounded(explanation: str, max_chars: int | None) -> str:
    """`explanation` cut to `max_chars` characters (None: no bound), its last one `_CUT` when cut (none left at 0)."""
    if max_chars is None or len(explanation) <= max_chars:
        return explanation
    return explanation[: max_chars - 1].rstrip() + _CUT if max_chars else ""


def _explanation_text(value: Any) -> str:
    """An explanation as text: a string as it is, none (null or missing) empty, anything else (a judge that ignores the
    schema: a number, a list, an object) as JSON text, not Python's repr."""
    if value is None:
        return ""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def parse_scores(text: str, count: int, max_chars: int | None = None) -> list[Score]:
    """Check the judge's answer: JSON with one finite score in [0, 1] for each block `"1"`..`"count"`.

    An explanation that is not a string (the schema says it is) is stored as JSON text (see `_explanation_text`).
    Explanations lose their NUL characters and read a lone surrogate as U+FFFD: JSON lets a judge write either
    (`\\u0000`, `\\ud800`), and no database text can hold it (a surrogate no UTF-8 codec encodes). One longer than
    `max_chars` (the schema's `maxLength`, see `explanation_limit`; None: no bound), which a judge that ignores the
    schema writes, is cut to it and ends with `…` (U+2026).

    Raises:
        JudgeError: `judge_bad_json` or `judge_bad_scores`, naming what is wrong.
    """
    try:
        data = json.loads(text, object_pairs_hook=_unique_keys)
    except (ValueError, RecursionError) as exc:  # also an integer past Python's digit limit, nesting past recursion
        raise JudgeError(f"judge answer is not JSON ({exc}): {text[:200]!r}", code="judge_bad_json") from exc
    entries = data.get("scores") if isinstance(data, dict) else None
    if not isinstance(entries, dict):
        raise JudgeError(f"judge answer has no `scores` object: {text[:200]!r}", code="judge_bad_scores")
    blocks = _block_keys(count)
    known = set(blocks)
    if unknown := [key for key in entries if key not in known]:
        raise JudgeError(
            f"scores for unknown trajectories {_listed(unknown)}; the ids are 1..{count}", code="judge_bad_scores"
        )
    missing = [int(block) for block in blocks if block not in entries]
    if missing:
        raise JudgeError(f"no score for trajectories {_listed(missing)}", code="judge_bad_scores")
    found = []
    for block in blocks:
        entry = entries[block]
        value = entry.get("score") if isinstance(entry, dict) else None
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not 0 <= value <= 1  # NaN fails it too; no float conversion, which a huge integer would overflow
        ):
            raise JudgeError(
                f"score {_quoted(value)} of trajectory {block} is not a number in [0, 1]", code="judge_bad_scores"
            )
        explanation = without_surrogates(_explanation_text(entry.get("explanation")).replace("\x00", "").strip())
        found.append(Score(int(block), float(value), _bounded(explanation, max_chars)))
    return found


def parse_cut(error: JudgeError, count: int, max_chars: int | None = None) -> list[Score]:
    """The scores of an answer cut at `max_tokens` (`error`, `judge_truncated`) that holds them all whole anyway: the
    cut fell after its JSON (a judge held to the schema writes nothing after it but its end-of-text token). A cut
    answer is only taken whole: one that is not JSON, or lacks a score, fails with `error` itself, cut as it was.

    Raises:
        JudgeError: `error`, when its answer is not one `parse_scores` takes.
    """
    try:
        return parse_scores(error.answer or "", count, max_chars)
    except JudgeError:
        raise error from None
