"""Lazy distributed state that fails loudly: read a value that exists only after some set-up step."""

from __future__ import annotations

from typing import TypeVar

T = TypeVar("T")


def required(value: T | None, message: str) -> T:
    """``value`` once it is set, or a ``RuntimeError`` with ``message`` saying what must happen first."""
    if value is None:
        raise RuntimeError(message)
    return value
