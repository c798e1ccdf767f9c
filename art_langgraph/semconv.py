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

* `node` — one run of a LangGraph node (`art.node.name`, `art.node.step`), child of the
  rollout span or of the node that contains it (a subgraph's nodes nest under the node that
  runs the subgraph). Model calls and tool calls made by the node are its children.
* `tool` — one tool execution (`gen_ai.operation.name = "execute_tool"`, `gen_ai.tool.name`,
  `gen_ai.tool.call.id`, arguments and result), child of the node that ran it.

Consumers must ignore kinds they do not know; only `llm` spans feed the token sequences, and
only the `rollout` span marks a trajectory complete and carries its rewards.

A top-level graph run outside any `rollout(...)` gets a `rollout` span of its own
(`art.rollout.source = "graph"`, id = the run's LangChain run id in hex). The app sets its task,
group, group size and split with the keys `art.task`, `art.group`, `art.group.size`,
`art.split` in the run's `config["metadata"]` (the same names as the attributes below).

Every span inside a rollout carries `art.rollout.id`, so the collector can place a span even
when it arrives before its parent or without it.

Other instrumentations of the same app (OpenInference, Langfuse's LangChain `CallbackHandler`,
OpenTelemetry GenAI instrumentations) may send their own spans of the same model calls to
the collector. So that no call counts twice, a model call is a turn of a trajectory only
through the record this package makes of it:

* `ARTChatModel` puts `art.traced = true` (`TRACED_RUN`) in the LangChain metadata of its
  runs. Instrumentations that copy run metadata onto their spans carry it (OpenInference in
  its `metadata` JSON, Langfuse as `langfuse.observation.metadata.art.traced`); a foreign
  model-call span with it is not a model call for the collector, whatever trace it is in.
* In a trajectory that holds an `llm` span, foreign model-call spans are never turns (an
  instrumentation of the OpenAI client under a call outside any rollout, say).

Foreign model-call spans without either mark (an app that does not use `ARTChatModel`) become
trajectories of their own trace, not token-exact.
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
ERROR_TYPE: Final = "error.type"
"""On a call that failed (OpenTelemetry's general attribute): the error's class name. The collector
leaves such an `llm` span out of the trajectory's turns: it sampled nothing to train on."""
GEN_AI_TOOL_DEFINITIONS: Final = "gen_ai.tool.definitions"
"""JSON list of OpenAI-format tool definitions bound to the call."""
GEN_AI_TOOL_NAME: Final = "gen_ai.tool.name"
"""Name of the tool a `tool` span executed."""
GEN_AI_TOOL_CALL_ID: Final = "gen_ai.tool.call.id"
"""Id of the model's tool call the `tool` span answers (when the tool was called by id)."""
GEN_AI_TOOL_CALL_ARGUMENTS: Final = "gen_ai.tool.call.arguments"
"""JSON (or plain text) arguments the tool was called with."""
GEN_AI_TOOL_CALL_RESULT: Final = "gen_ai.tool.call.result"
"""The tool's result as text (a `ToolMessage`'s content, or the returned value as JSON)."""

# --- art.* -------------------------------------------------------------------------------
SPAN_KIND: Final = "art.span.kind"
"""`rollout`, `llm`, `node`, `tool` or `reward` (see module docstring); consumers ignore other values."""
SPAN_KIND_ROLLOUT: Final = "rollout"
SPAN_KIND_LLM: Final = "llm"
SPAN_KIND_NODE: Final = "node"
SPAN_KIND_TOOL: Final = "tool"
SPAN_KIND_REWARD: Final = "reward"
"""A reward given apart from the rollout span: `art.reward.name` / `art.reward.value` attributes and `art.reward`
events."""

NODE_NAME: Final = "art.node.name"
"""Name of the LangGraph node a `node` span ran (`langgraph_node`)."""
NODE_STEP: Final = "art.node.step"
"""LangGraph superstep the node ran in (`langgraph_step`, int)."""
INTERRUPT_EVENT: Final = "art.interrupt"
"""Span event on a `node` span whose node paused the graph (`interrupt()`); not an error."""
CANCELLED_EVENT: Final = "art.cancelled"
"""Span event on a rollout, `node` or `tool` span whose task was cancelled (`asyncio.CancelledError`: the app
left `astream()` while it ran, or a timeout); not an error."""
ROLLOUT_SOURCE: Final = "art.rollout.source"
"""On the rollout span: `rollout` (opened by `rollout(...)`) or `graph` (a top-level graph run
outside any rollout; its id is the run's LangChain run id in hex)."""

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
TRACED_RUN: Final = "art.traced"
"""Key `ARTChatModel` sets to `true` in the LangChain metadata of each of its runs (not a span
attribute): other instrumentations that record run metadata mark their span of the call with
it, and the collector leaves such spans out of trajectories (the `llm` span records the call)."""
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

MAX_NAME_LENGTH: Final = 256
"""Most characters of an `art.rollout.id`, `art.task`, `art.group` or reward name (none may hold a NUL): the
collector rejects a span with a longer one, rollout span and rewards included."""
MAX_SPLIT_LENGTH: Final = 64
"""Most characters of an `art.split`."""
MAX_COUNT: Final = 2**31 - 1
"""Largest `art.group.size` or `art.policy.step` the collector stores."""
