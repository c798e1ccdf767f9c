"""What the engine returned beyond the OpenAI schema: token ids, sampled logprobs, policy step.

vLLM with `return_token_ids` puts `prompt_token_ids` at the top level of a response (of each
choice's first chunk when streaming) and `token_ids` in each choice (each content chunk when
streaming, the chunk's choice named by its `index`); `logprobs=True` gives
`choices[i].logprobs.content[j].logprob` per sampled token. An OpenAI-compatible engine that
ignores `return_token_ids` sends no ids: no token data is recorded then, and a warning (once per
model) says that those trajectories will be re-tokenized for training.
"""

from __future__ import annotations

import logging
from typing import Any, TypedDict

from art_langgraph import semconv
from art_langgraph._counts import ProcessLock

__all__ = [
    "ART_METADATA_KEY",
    "STREAM_PIECE_KEY",
    "ArtTokenData",
    "StreamPiece",
    "StreamTokens",
    "choice_token_data",
    "chunk_index",
    "policy_step",
    "stream_piece",
    "unreadable_piece",
]

_logger = logging.getLogger(__name__)

ART_METADATA_KEY = "art"
"""Key of `AIMessage.response_metadata` that holds an `ArtTokenData`."""
STREAM_PIECE_KEY = "_art_piece"
"""Private `response_metadata` key that carries a chunk's `StreamPiece` from `ARTChatModel`'s chunk
converter to its stream wrapper, which removes it before the chunk reaches the caller."""


class ArtTokenData(TypedDict):
    """Exact engine data of one completion, kept on `AIMessage.response_metadata["art"]`."""

    prompt_token_ids: list[int]
    """Prompt token ids exactly as the engine saw them (chat template applied)."""
    completion_token_ids: list[int]
    """Sampled completion token ids, EOS included."""
    logprobs: list[float]
    """Log-probability of each sampled completion token under the serving policy."""
    policy_step: int
    """Checkpoint step from the response model name `name@step`; 0 for anything else."""


class StreamPiece(TypedDict):
    """The token data one stream chunk carries (plain JSON values: it rides on the chunk's metadata)."""

    index: int | None
    """The choice the chunk belongs to; None for a chunk of no choice (the usage chunk)."""
    model: str | None
    """The model that answered."""
    prompt_token_ids: list[int] | None
    """The prompt's ids, on the first chunk (of each choice, for vLLM); None elsewhere."""
    completion_token_ids: list[int] | None
    """The ids sampled in this chunk; None when the chunk has no `token_ids`."""
    logprobs: list[float]
    """The sampled logprobs of this chunk's tokens."""
    finished: bool
    """Whether the chunk carries its choice's finish reason: the engine sends no token of that choice after it."""
    readable: bool
    """False for a chunk whose token data could not be read (`unreadable_piece`): its call then records none."""


def unreadable_piece(index: int | None) -> StreamPiece:
    """The piece of a chunk of choice `index` whose token data could not be read (logged): its call records none."""
    return StreamPiece(index=index, model=None, prompt_token_ids=None, completion_token_ids=None, logprobs=[],
                       finished=False, readable=False)


def policy_step(model_name: str | None) -> int:
    """Parse the checkpoint step from a served model name (`agent@12` → 12, else 0).

    Only ASCII digits make a step, as the trainer names its checkpoints: `str.isdigit` also takes digits that `int`
    refuses (`agent@²`), which lost every call's token data. So does a number past `semconv.MAX_COUNT`, the largest
    step the collector stores (a date-stamped name, `model@20250101120000`): it rejected every call's span.
    """
    if not model_name or "@" not in model_name:
        return 0
    digits = model_name.rsplit("@", 1)[1].lstrip("0")  # `int` refuses more than 4300 digits, leading zeros too
    if not (digits.isascii() and digits.isdigit()) or len(digits) > len(str(semconv.MAX_COUNT)):
        return 0  # `agent@0` too
    step = int(digits)
    return step if step <= semconv.MAX_COUNT else 0


_warned_models: set[str | None] = set()
_warned_lock = ProcessLock()
"""Guards `_warned_models`; a forked child gets a new one (`_counts`)."""


def _warn_no_token_ids(model: str | None) -> None:
    """Say once per model that its engine sent no token ids (so nothing is token-exact)."""
    with _warned_lock:
        if model in _warned_models:
            return
        _warned_models.add(model)
    _logger.warning(
        "art_langgraph: the engine serving %r returned no token ids (it ignores `return_token_ids`), so its "
        "trajectories will be re-tokenized for training (not token-exact); serve the model with vLLM (the ART "
        "trainer) to train on the exact tokens.",
        model,
    )


def _build_token_data(
    model: str | None, prompt: list[int] | None, completion: list[int] | None, logprobs: list[float]
) -> ArtTokenData | None:
    """Token data of one choice, or None when ids are missing (warned when even the prompt's are)."""
    if prompt is None:
        _warn_no_token_ids(model)
    if prompt is None or completion is None:
        return None
    return ArtTokenData(
        prompt_token_ids=list(prompt),
        completion_token_ids=list(completion),
        logprobs=list(logprobs),
        policy_step=policy_step(model),
    )


def _logprobs(choice: dict[str, Any]) -> list[float]:
    content = (choice.get("logprobs") or {}).get("content") or []
    return [float(item["logprob"]) for item in content]


def choice_token_data(response: dict[str, Any], choice: dict[str, Any]) -> ArtTokenData | None:
    """Token data of one choice of a non-streamed chat completion (as a dict); None without ids.

    The final completion the OpenAI client assembles from a structured-output stream has the
    prompt's ids but not the choice's: None, without a warning (the chunks carried them).
    """
    return _build_token_data(response.get("model"), response.get("prompt_token_ids"), choice.get("token_ids"),
                             _logprobs(choice))


def _unwrap(event: dict[str, Any]) -> dict[str, Any] | None:
    """The chat-completion chunk of a stream event; None for an event that is not one.

    A plain stream sends chunks as they are. `beta.chat.completions.stream` (LangChain's path for
    a `response_format`, i.e. structured output) wraps each as `{"type": "chunk", "chunk": {...}}`
    and adds events of other types (`content.delta`, ...) that repeat what the chunks hold.
    """
    if "type" not in event:
        return event
    inner = event.get("chunk")
    return inner if event["type"] == "chunk" and isinstance(inner, dict) else None


def chunk_index(event: dict[str, Any]) -> int | None:
    """The choice a stream event's chunk belongs to; None for a chunk of no choice or an event that is not a chunk."""
    choices = (_unwrap(event) or {}).get("choices") or []
    return int(choices[0].get("index") or 0) if choices else None  # one choice per chunk; LangChain reads the first


def stream_piece(event: dict[str, Any]) -> StreamPiece | None:
    """The token data one stream event carries; None for an event that is not a chunk."""
    chunk = _unwrap(event)
    if chunk is None:
        return None
    choices = chunk.get("choices") or []
    choice = choices[0] if choices else {}
    prompt, completion = chunk.get("prompt_token_ids"), choice.get("token_ids")
    return StreamPiece(
        index=chunk_index(chunk),
        model=chunk.get("model"),
        prompt_token_ids=list(prompt) if prompt is not None else None,
        completion_token_ids=list(completion) if completion is not None else None,
        logprobs=_logprobs(choice),
        finished=choice.get("finish_reason") is not None,
        readable=True,
    )


class StreamTokens:
    """Token data of one streamed call, gathered per choice from its chunks' `StreamPiece`s."""

    def __init__(self) -> None:
        self._model: str | None = None
        self._prompt: list[int] | None = None
        self._completion: dict[int, list[int]] = {}
        self._logprobs: dict[int, list[float]] = {}
        self._unreadable = False

    def add(self, piece: StreamPiece) -> ArtTokenData | None:
        """Take in one chunk's piece; return what goes on that chunk's `response_metadata["art"]`, if anything.

        Choice 0's token data, whole, goes on the chunk that finishes choice 0, and on no other chunk: the message
        LangChain assembles from the chunks then holds what `invoke`'s holds, whether it adds them up (`+`, which
        concatenates lists: `stream()`, `astream_events` v2, `stream_mode="messages"`) or keeps each key's last value
        (`stream_events(version="v3")`, and a node's `invoke` under it). A stream left before choice 0 finished
        carries none: its ids are a prefix, no turn.
        """
        if not piece["readable"]:
            self._unreadable = True
            return None
        self._model = self._model or piece["model"]
        if piece["prompt_token_ids"] is not None and self._prompt is None:
            self._prompt = piece["prompt_token_ids"]
        if piece["completion_token_ids"] is not None and piece["index"] is not None:
            self._completion.setdefault(piece["index"], []).extend(piece["completion_token_ids"])
            self._logprobs.setdefault(piece["index"], []).extend(piece["logprobs"])
        return self.token_data(0) if piece["finished"] and piece["index"] == 0 else None

    def token_data(self, index: int) -> ArtTokenData | None:
        """Choice `index`'s token data; None when the engine sent no ids for it, or a chunk's could not be read."""
        if self._unreadable:
            return None
        return _build_token_data(self._model, self._prompt, self._completion.get(index), self._logprobs.get(index, []))
