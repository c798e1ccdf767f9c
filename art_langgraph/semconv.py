"""The span contract between `art_langgraph` (producer) and `collector` (consumer).

Every name the collector reads from a span is declared here, once. Model-call spans follow
the OpenTelemetry GenAI semantic conventions (`gen_ai.*`); what those conventions do not
cover (rollout identity, exact token ids, sampled logprobs) lives under `art.*`.

Span kinds emitted by this package (attribute `art.span.kind`):

* `rollout` — root of one trajectory, opened by `rollout(...)`. Carries the rollout id,
  group, task, split, metadata; rewards given inside it are span events named `art.reward`.
* `llm` — one chat completion (`gen_ai.operation.name = "chat"`). Carries the input and output
  messages, tool definitions, usage, and the exact `art.prompt_token_ids`,
  `art.completion_token_ids` and `art.completion_logprobs` that the engine returned.

Every span inside a rollout carries `art.rollout.id`, so the collector can place a span even
when it arrives before its parent or without it.
"""

from __future__ import annotations

from typing import Final

# --- OpenTelemetry GenAI semantic conventions --------------------------------------------
GEN_AI_OPERATION_NAME: Final = "gen_ai.operation.name"
"""`chat` for a chat completion."""
GEN_AI_SYSTEM: Final = "gen_ai.system"
"""Provider name; this package writes `art`."""
GEN_AI_REQUEST_MODEL: Final = "gen_ai.request.model"
GEN_AI_RESPONSE_MODEL: Final = "gen_ai.response.model"
GEN_AI_RESPONSE_ID: Final = "gen_ai.response.id"
GEN_AI_RESPONSE_FINISH_REASONS: Final = "gen_ai.response.finish_reasons"
GEN_AI_USAGE_INPUT_TOKENS: Final = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS: Final = "gen_ai.usage.output_tokens"
GEN_AI_INPUT_MESSAGES: Final = "gen_ai.input.messages"
"""JSON list of OpenAI-format chat messages sent to the model."""
GEN_AI_OUTPUT_MESSAGES: Final = "gen_ai.output.messages"
"""JSON list with the assistant message the model returned (OpenAI format)."""
GEN_AI_TOOL_DEFINITIONS: Final = "gen_ai.tool.definitions"
"""JSON list of OpenAI-format tool definitions bound to the call."""

# --- art.* -------------------------------------------------------------------------------
SPAN_KIND: Final = "art.span.kind"
"""`rollout` or `llm` (see module docstring)."""
SPAN_KIND_ROLLOUT: Final = "rollout"
SPAN_KIND_LLM: Final = "llm"

ROLLOUT_ID: Final = "art.rollout.id"
"""Trajectory id; on the rollout span and on every span inside it."""
GROUP: Final = "art.group"
"""GRPO group id: trajectories with the same group are compared with each other."""
GROUP_SIZE: Final = "art.group.size"
"""Number of rollouts expected in the group, when the producer knows it (`gather`)."""
TASK: Final = "art.task"
"""Task name: the default grouping key when no explicit group is given."""
SPLIT: Final = "art.split"
"""`train` or `val` (any string; only `train` is leased for training)."""
METADATA: Final = "art.metadata"
"""JSON object of free-form metadata given to `rollout(...)`."""
POLICY_STEP: Final = "art.policy.step"
"""Training step of the checkpoint that answered (`name@step`); 0 for the base model."""

PROMPT_TOKEN_IDS: Final = "art.prompt_token_ids"
"""Exact prompt token ids the engine saw (int array)."""
COMPLETION_TOKEN_IDS: Final = "art.completion_token_ids"
"""Exact completion token ids the engine sampled, EOS included (int array)."""
COMPLETION_LOGPROBS: Final = "art.completion_logprobs"
"""Log-probability of each sampled completion token under the serving policy (double array)."""

REWARD_EVENT: Final = "art.reward"
"""Span event on the rollout span: one named reward."""
REWARD_NAME: Final = "art.reward.name"
REWARD_VALUE: Final = "art.reward.value"
