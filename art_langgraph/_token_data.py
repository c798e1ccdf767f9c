"""What the engine returned beyond the OpenAI schema: token ids, sampled logprobs, policy step.

vLLM with `return_token_ids` puts `prompt_token_ids` at the top level of a response (first
chunk when streaming) and `token_ids` in each choice (each content chunk when streaming);
`logprobs=True` gives `choices[i].logprobs.content[j].logprob` per sampled token.
"""

from __future__ import annotations

from typing import Any, TypedDict

__all__ = ["ART_METADATA_KEY", "ArtTokenData", "chunk_token_data", "choice_token_data", "policy_step"]

ART_METADATA_KEY = "art"
"""Key of `AIMessage.response_metadata` that holds an `ArtTokenData`."""


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


def policy_step(model_name: str | None) -> int:
    """Parse the checkpoint step from a served model name (`agent@12` → 12, else 0)."""
    if not model_name or "@" not in model_name:
        return 0
    suffix = model_name.rsplit("@", 1)[1]
    return int(suffix) if suffix.isdigit() else 0


def _logprobs(choice: dict[str, Any]) -> list[float]:
    content = (choice.get("logprobs") or {}).get("content") or []
    return [float(item["logprob"]) for item in content]


def choice_token_data(response: dict[str, Any], choice: dict[str, Any]) -> ArtTokenData:
    """Token data of one choice of a non-streamed chat completion (as a dict)."""
    return ArtTokenData(
        prompt_token_ids=list(response.get("prompt_token_ids") or []),
        completion_token_ids=list(choice.get("token_ids") or []),
        logprobs=_logprobs(choice),
        policy_step=policy_step(response.get("model")),
    )


def chunk_token_data(chunk: dict[str, Any]) -> dict[str, list[int] | list[float]]:
    """The part of the token data one stream chunk carries (lists to concatenate).

    No `policy_step` here: merging chunk metadata sums integers; the stream wrapper adds it once.
    """
    choices = chunk.get("choices") or []
    choice = choices[0] if choices else {}
    return {
        "prompt_token_ids": list(chunk.get("prompt_token_ids") or []),
        "completion_token_ids": list(choice.get("token_ids") or []),
        "logprobs": _logprobs(choice),
    }
