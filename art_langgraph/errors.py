"""Errors the plugin raises: each has a `code` and a `hint` that says what to do."""

from __future__ import annotations

__all__ = ["ARTError", "UnsupportedOption"]


class ARTError(Exception):
    """Base of the plugin's errors.

    Attributes:
        code: Stable machine-readable error code.
        hint: What to change to make the call work.
    """

    code: str = "art_error"

    def __init__(self, message: str, hint: str) -> None:
        super().__init__(f"[{self.code}] {message}. Hint: {hint}")
        self.message = message
        self.hint = hint


class UnsupportedOption(ARTError, ValueError):
    """An argument LangChain accepts but `ARTChatModel` cannot honour (it is refused, not ignored)."""

    code = "unsupported_option"
