"""Re-tokenize a conversation with the model's chat template, marking the assistant tokens.

Trajectories whose spans came without engine token ids (`token_exact=False`: another
instrumentation, a foreign span) still carry their messages. They are rendered with the chat
template as vLLM renders them (a tool call's `arguments` JSON string parsed into an object first, empty
`arguments` rendered as `{}`; content given as text parts handed to a template that renders parts, their texts
joined by newlines for one that does not; a part that is not text, such as an image, is refused);
a token is an assistant token when the text it comes from was added by an assistant message.
A tool call whose `arguments` string is not JSON is refused: vLLM (0.32) renders it as `{}` in later prompts, and
its own parser (`hermes`) never returns such a call (the model's text stays content), so the tokens sampled for
it are unknown and neither rendering reproduces them. Arguments that are JSON but no object (`[1, 2]`, `3`, a JSON
string) are what that parser returns for the value the model sampled there (dumped as JSON): the template gets the
value, so that it writes that JSON text as the model sampled it, though vLLM renders `{}` in later prompts (the
sampled tokens win); a JSON string's own text where the template writes a string as it is (the bundled template).
Such calls of the assistant messages trained are counted (`Retokenized.non_object_arguments`).
Arguments that are neither a string nor an object (a list, a number) are refused: that parser never returns them,
vLLM's API refuses them and renders them as `{}`, so the tokens sampled for them are unknown.
The text is tokenized as one piece, except where a token would straddle the start or end of an assistant message's
text (a reply beginning with whitespace, whose first character SmolLM2's tokenizer merges with the header's newline
into one token, such as two newlines): the text is then tokenized apart at that point, so the prompt ends with the
header's own tokens, as the engine tokenized the prompt, and the reply's tokens are those of its text alone, the
tokens the model sampled after the header. Each such cut is logged and counted (`Retokenized.split_edges`). (A
later turn's prompt, which the engine tokenized whole, held the merged token there instead: one sequence cannot hold
both, and the sampled tokens win.) The spans are found by rendering growing prefixes of the conversation, so any
template that renders a conversation as the concatenation of its turns works, tool calls included. A template that
leaves an assistant message's tool calls out (no tool support) is refused: that turn would train as an empty one.
An assistant message that opens the conversation had no prompt, so the model did not sample it (a canned greeting):
it stays out of the mask.
Trailing template text after the end-of-turn token (a newline) is not sampled by the model and
is left out of the mask.
The end-of-turn token is the tokenizer's eos, or the special token the template writes right after
an assistant message where that is another one (Gemma's `<end_of_turn>`, whose eos is `<eos>`).
A reply the token limit cut (finish reason `length`) was not ended by the model: its end-of-turn token stays in the
sequence (later turns were sampled after it) but out of the mask.
"""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import Collection
from typing import Any, NamedTuple

from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from collector.spans import read_json

__all__ = ["RetokenizeError", "Retokenized", "render_with_assistant_mask"]

logger = logging.getLogger(__name__)


class RetokenizeError(ValueError):
    """The chat template cannot render this conversation, or not as a growing sequence of turns."""


class Retokenized(NamedTuple):
    """A re-tokenized conversation."""

    token_ids: list[int]
    mask: list[int]
    """1 on the tokens trained (`render_with_assistant_mask`), 0 elsewhere."""
    split_edges: int
    """How many edges of assistant messages' texts a token straddled, where the text was tokenized apart."""
    non_object_arguments: int
    """How many tool calls of the assistant messages trained have `arguments` that are JSON but no object (`[1, 2]`,
    `3`, `null`, a JSON string), trained as vLLM's parser returns them (`_parsed_arguments`)."""


_TEMPLATE_ERRORS = (TemplateError, TypeError, KeyError, ValueError)
"""What rendering a conversation the template does not expect raises: jinja2's errors (an undefined field, such as
a foreign tool call without a `name`; the template's own `raise_exception`), and the errors of Python operations
and filters a template runs on such a value."""


def _render(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
            generation_prompt: bool) -> str:
    """The chat template's text of `messages`.

    Raises:
        RetokenizeError: the template failed on them (its error chained) or returned something else than text.
    """
    try:
        text = tokenizer.apply_chat_template(
            messages, tools=tools or None, tokenize=False, add_generation_prompt=generation_prompt
        )
    except _TEMPLATE_ERRORS as exc:
        raise RetokenizeError(f"the chat template cannot render the conversation: {type(exc).__name__}: {exc}") from exc
    if not isinstance(text, str):
        raise RetokenizeError(f"the chat template returned {type(text).__name__}, not text")
    return text


def _as_served(messages: list[dict[str, Any]], tokenizer: PreTrainedTokenizerBase,
               tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """`messages` as vLLM hands them to the chat template: content given as parts as `_served_content` says, and a
    tool call's `arguments` as `_parsed_arguments` says.

    Raises:
        RetokenizeError: a content part is not text, or a tool call's `arguments` are neither JSON text nor an object.
    """
    as_parts = any(isinstance(m.get("content"), list) for m in messages) and _renders_content_parts(tokenizer, tools)
    served = []
    for index, message in enumerate(messages):
        if isinstance(message.get("content"), list):
            message = {**message, "content": _served_content(message["content"], index, as_parts)}
        calls = message.get("tool_calls")
        if message.get("role") == "assistant" and isinstance(calls, list):
            message = {**message, "tool_calls": [_parsed_arguments(call, index, tokenizer, tools) for call in calls]}
        served.append(message)
    return served


_TEXT_PART_KEYS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}
"""The content part types vLLM reads as text, and the key of each that holds the text."""


def _renders_content_parts(tokenizer: PreTrainedTokenizerBase, tools: list[dict[str, Any]] | None) -> bool:
    """Whether the chat template renders content given as a text part as it renders the same text given as a string.

    vLLM then hands it content parts as they are (its `openai` content format); otherwise (`string`) it joins their
    texts with newlines first, as such a template would render the parts' Python text or fail on them.
    """
    as_text = [{"role": "user", "content": _PROBE}]
    as_parts = [{"role": "user", "content": [{"type": "text", "text": _PROBE}]}]
    try:
        rendered = _render(tokenizer, as_parts, tools, generation_prompt=True)
        return rendered == _render(tokenizer, as_text, tools, generation_prompt=True)
    except RetokenizeError:  # it fails on parts (or on the probe: the conversation's own rendering then says why)
        return False


def _served_content(parts: list[Any], index: int, as_parts: bool) -> str | list[dict[str, str]]:
    """Message `index`'s content `parts` as vLLM hands them to the template: text parts (`as_parts`), or their
    texts joined by newlines.

    Raises:
        RetokenizeError: a part is not text (an image or other media, which re-tokenizing cannot reproduce).
    """
    texts = [_part_text(part, index) for part in parts]
    return [{"type": "text", "text": text} for text in texts] if as_parts else "\n".join(texts)


def _part_text(part: Any, index: int) -> str:
    """The text of content part `part` of message `index` (a string, or a text-like part as vLLM reads one)."""
    if isinstance(part, str):
        return part
    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
    key = _TEXT_PART_KEYS.get(kind) if isinstance(part, dict) and isinstance(kind, str) else None
    text = part.get(key) if key else None
    if not isinstance(text, str):
        raise RetokenizeError(f"message {index} has a content part of type {kind!r} without text; only text parts "
                              "can be re-tokenized")
    return text


def _parsed_arguments(call: Any, index: int, tokenizer: PreTrainedTokenizerBase,
                      tools: list[dict[str, Any]] | None) -> Any:
    """`call` of message `index` with its `function.arguments` as the template gets them: a JSON string parsed into
    its value (an object, as vLLM hands it over, which templates write with `tojson`, `{"a": 2}` where the string
    may have been `{"a":2}`; or any other value the model sampled there), but a JSON string whose value is a string
    kept as it is where the template writes such a string as it is; `{}` when empty or absent. `call` itself when
    its arguments are an object or it has no `function` object.

    Raises:
        RetokenizeError: `arguments` is a string that is not JSON, or neither a string nor an object.
    """
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict):
        return call
    arguments = function.get("arguments")
    if arguments is None or arguments == "":  # vLLM renders a call without arguments as one with no parameters
        return {**call, "function": {**function, "arguments": {}}}
    if isinstance(arguments, dict):
        return call
    if not isinstance(arguments, str):
        raise RetokenizeError(
            f"message {index} has a tool call {function.get('name')!r} whose arguments are of type "
            f"{type(arguments).__name__}, neither JSON text nor an object: the tokens sampled for it are unknown "
            "(vLLM's parser returns JSON text; vLLM renders them as {} in later prompts)"
        )
    try:
        value = read_json(arguments)
    except ValueError as exc:
        raise RetokenizeError(
            f"message {index} has a tool call {function.get('name')!r} whose arguments are not JSON ({exc}): the "
            "tokens sampled for it are unknown (vLLM renders them as {} in later prompts)"
        ) from exc
    if isinstance(value, str) and _writes_argument_strings_verbatim(tokenizer, tools, call):
        return call
    return {**call, "function": {**function, "arguments": value}}


def _non_object_arguments(message: dict[str, Any]) -> int:
    """How many tool calls of served assistant `message` (`_as_served`) have `arguments` that are not an object: JSON
    that is no object, as `_parsed_arguments` hands it to the template."""
    calls = message.get("tool_calls")
    return sum(isinstance(call, dict) and isinstance(call.get("function"), dict)
               and not isinstance(call["function"].get("arguments"), dict)
               for call in calls) if isinstance(calls, list) else 0


def _writes_argument_strings_verbatim(tokenizer: PreTrainedTokenizerBase, tools: list[dict[str, Any]] | None,
                                      call: dict[str, Any]) -> bool:
    """Whether the chat template writes tool call `call` with an `arguments` string as it is (the bundled template),
    not as a JSON string (`tojson`, as templates write the object vLLM hands them)."""
    probed = {**call, "function": {**call["function"], "arguments": _PROBE_ARGUMENTS}}
    probe = [{"role": "user", "content": "?"}, {"role": "assistant", "content": None, "tool_calls": [probed]}]
    return _PROBE_ARGUMENTS in _render(tokenizer, probe, tools, generation_prompt=False)


def _encode(tokenizer: PreTrainedTokenizerBase, text: str,
            edges: list[int]) -> tuple[list[int], list[tuple[int, int]], int]:
    """Token ids of `text`, the character span of each, and the number of cuts: `text` is tokenized apart at each
    of `edges` (where assistant messages' texts start and end) a token would straddle, so that no token holds text
    of both sides."""
    cuts: list[int] = []
    while True:
        ids: list[int] = []
        offsets: list[tuple[int, int]] = []
        for start, end in itertools.pairwise([0, *cuts, len(text)]):
            encoded = tokenizer(text[start:end], add_special_tokens=False, return_offsets_mapping=True)
            ids += encoded["input_ids"]
            offsets += [(s + start, e + start) for s, e in encoded["offset_mapping"]]
        straddled = [edge for edge in edges if any(s < edge < e for s, e in offsets)]
        if not straddled:
            if cuts:
                logger.info("re-tokenized apart at %d assistant message edge(s) a token straddled (characters %s)",
                            len(cuts), cuts)
            return ids, offsets, len(cuts)
        cuts = sorted({*cuts, *straddled})


_PROBE = "art-retokenize-probe"
"""The content of the assistant message `_end_of_turn_ids` renders to find what the template writes after one."""
_PROBE_ARGUMENTS = json.dumps(_PROBE)
"""The `arguments` (a JSON string) `_writes_argument_strings_verbatim` renders a tool call with: `tojson` escapes
its quotes."""


def _end_of_turn_ids(tokenizer: PreTrainedTokenizerBase, tools: list[dict[str, Any]] | None) -> set[int]:
    """The token ids that end a sampled assistant turn: the eos token, and the special token the chat template
    writes right after an assistant message's content (where the template drops the content: eos alone)."""
    ends = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    probe = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _PROBE}]
    rendered = _render(tokenizer, probe, tools, generation_prompt=False)
    if _PROBE not in rendered:
        return ends
    after = rendered[rendered.rindex(_PROBE) + len(_PROBE):]
    special = {index for index, token in tokenizer.added_tokens_decoder.items() if token.special}
    ends.update(index for index in tokenizer(after, add_special_tokens=False)["input_ids"][:1] if index in special)
    return ends


def render_with_assistant_mask(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    length_cut: Collection[int] = (),
) -> Retokenized:
    """Return the token ids of `messages` rendered by the chat template and the assistant mask.

    Args:
        tokenizer: a fast tokenizer with a chat template.
        messages: OpenAI-format messages, rendered as vLLM renders them (`_as_served`): content may be a list of
            text parts; assistant messages may carry `tool_calls`, whose `arguments` strings are parsed into objects.
        tools: OpenAI tool definitions passed to the template.
        length_cut: indices in `messages` of assistant messages the token limit cut (`Trajectory.length_cut`).

    Returns:
        `(token_ids, mask, split_edges, non_object_arguments)`: mask is 1 on tokens rendered from assistant messages
        but the first message (up to and including the end-of-turn token, excluding it for a message in
        `length_cut`), 0 elsewhere; `split_edges` counts the edges of assistant messages' texts where the text was
        tokenized apart; `non_object_arguments` the tool calls of those messages whose `arguments` are JSON but no
        object.

    Raises:
        RetokenizeError: no assistant message after the first message, no chat template, a content part that is not
            text, a template that fails on the conversation, one that leaves an assistant message's tool calls out
            (no tool support), or one whose rendering of a longer conversation does not extend the rendering of a
            shorter one.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise RetokenizeError("the tokenizer has no chat template; set one (or serve a model that ships one)")
    if not any(m.get("role") == "assistant" for m in messages[1:]):
        raise RetokenizeError("the conversation has no assistant message after its first message: nothing the model "
                              "sampled to train on")
    messages = _as_served(messages, tokenizer, tools)
    full = _render(tokenizer, messages, tools, generation_prompt=False)
    spans: list[tuple[int, int, bool]] = []
    non_object = 0
    for index, message in enumerate(messages):
        if message.get("role") != "assistant" or not index:  # message 0 had no prompt: the model did not sample it
            continue
        before = _render(tokenizer, messages[:index], tools, generation_prompt=True)
        upto = _render(tokenizer, messages[: index + 1], tools, generation_prompt=False)
        if not (upto.startswith(before) and full.startswith(upto)):
            raise RetokenizeError(
                f"the chat template does not render message {index} as an extension of the ones before it; "
                "such trajectories cannot be re-tokenized (record them with engine token ids instead)"
            )
        if message.get("tool_calls"):  # rendered again without them: a template without tool support drops them
            callless = {key: value for key, value in message.items() if key != "tool_calls"}
            if upto == _render(tokenizer, [*messages[:index], callless], tools, generation_prompt=False):
                raise RetokenizeError(
                    f"the chat template does not render the tool calls of message {index} (it has no tool support), "
                    "so they cannot be trained; serve a template that renders them (--chat-template)"
                )
        spans.append((len(before), len(upto), index in length_cut))
        non_object += _non_object_arguments(message)
    edges = sorted({edge for start, end, _ in spans for edge in (start, end)})
    ids, offsets, split_edges = _encode(tokenizer, full, edges)
    mask = [0] * len(ids)
    end_of_turn = _end_of_turn_ids(tokenizer, tools)
    for start, end, cut in spans:
        inside = [i for i, (s, e) in enumerate(offsets) if s >= start and e <= end and e > s]
        ends = [i for i in inside if ids[i] in end_of_turn]
        if ends:
            inside = [i for i in inside if i < ends[-1] or (i == ends[-1] and not cut)]
        for i in inside:
            mask[i] = 1
    return Retokenized(ids, mask, split_edges, non_object)
