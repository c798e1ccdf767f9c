"""art-langgraph: reinforcement learning for the LangGraph agents you already run.

Swap the chat model for `ARTChatModel` (or `init_chat_model`), optionally wrap runs in
`rollout(...)`, give rewards, and the collector + trainer do the rest.
"""

from art_langgraph._gather import gather, gather_sync
from art_langgraph._rollout import Rollout, areward, current_rollout, reward, rollout
from art_langgraph._tracing import configure, flush, shutdown
from art_langgraph.chat_model import ARTChatModel, init_chat_model

__all__ = [
    "ARTChatModel",
    "Rollout",
    "areward",
    "configure",
    "current_rollout",
    "flush",
    "gather",
    "gather_sync",
    "init_chat_model",
    "reward",
    "rollout",
    "shutdown",
]
