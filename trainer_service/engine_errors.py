"""`EngineError`: what the vLLM supervisor and vLLM's adapter endpoints raise."""

from __future__ import annotations

__all__ = ["EngineError"]


class EngineError(RuntimeError):
    """vLLM could not be started, died, or refused a request."""
