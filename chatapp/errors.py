"""One line for the user from any exception, wherever the app catches one."""

from __future__ import annotations

from engine.errors import EngineError


def describe_error(exc: BaseException) -> str:
    """One line for the user. Engine errors already name the thing at fault; others get their type."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    if isinstance(exc, EngineError) and text:
        return text
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
