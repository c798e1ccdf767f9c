"""art-langgraph: reinforcement learning for the LangGraph agents you already run.

Swap the chat model for `ARTChatModel` (or `init_chat_model`), optionally wrap runs in
`rollout(...)`, give rewards, and the collector + trainer do the rest.
"""

from art_langgraph import _graph_tracing  # noqa: F401  (installs the graph node/tool tracer)
from art_langgraph._chat_node import chat_node
from art_langgraph._gather import gather, gather_sync
from art_langgraph._init_chat_model import ConfigurableARTChatModel, init_chat_model
from art_langgraph._rewards import areward, reward
from art_langgraph._rollout import Rollout, current_rollout, rollout
from art_langgraph._tracing import configure, dropped_spans, flush, shutdown
from art_langgraph.chat_model import ARTChatModel
from art_langgraph.errors import ARTError, UnsupportedOption

__all__ = [
    "ARTChatModel",
    "ARTError",
    "ConfigurableARTChatModel",
    "Rollout",
    "UnsupportedOption",
    "areward",
    "chat_node",
    "configure",
    "current_rollout",
    "dropped_spans",
    "flush",
    "gather",
    "gather_sync",
    "init_chat_model",
    "reward",
    "rollout",
    "shutdown",
]
