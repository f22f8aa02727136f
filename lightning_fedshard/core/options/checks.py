"""Checks of user input that raise ``ValueError`` quoting the offending value, shared by the constructors.

``bool`` is refused where an integer or a number is expected, although it is one in Python: ``sync_every=True`` is a
mistake, not a period of one step.
"""

from __future__ import annotations


def check_positive_int(
    name: str,
    value: object,
    *,
    allow_none: bool = False,
    minimum: int = 1,
    what: str | None = None,
    expected: str | None = None,
) -> None:
    """Raise ``ValueError`` unless ``value`` is an integer of at least ``minimum`` (not a ``bool``).

    The message reads "`name` must be a positive integer, got 0." (with ``minimum=2``: "an integer of 2 or more"). With
    ``allow_none``, ``None`` passes but the message does not mention it unless ``expected`` does.

    Args:
        name: The argument as the user spells it, quoted in backticks (e.g. ``"sync_every"``,
            ``"Elastic(min_groups=...)"``).
        value: What the user passed.
        allow_none: Accept ``None`` (an optional argument left unset).
        minimum: The smallest value accepted.
        what: The subject of the message in place of the quoted ``name`` (e.g. ``"Every period of `levels`"``).
        expected: What the value must be, in place of "a positive integer" (e.g. ``"a positive integer or None"``).

    Raises:
        ValueError: If ``value`` is not an ``int`` (or is a ``bool``), or is below ``minimum``.
    """
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        if expected is None:
            expected = "a positive integer" if minimum == 1 else f"an integer of {minimum} or more"
        raise ValueError(f"{_subject(name, what)} must be {expected}, got {value!r}.")


def check_positive_number(name: str, value: object, *, unit: str | None = None, what: str | None = None) -> None:
    """Raise ``ValueError`` unless ``value`` is an ``int`` or a ``float`` above 0 (not a ``bool``, not NaN).

    The message reads "`name` must be a positive number, got 0." (with ``unit="seconds"``: "a positive number of
    seconds").

    Args:
        name: The argument as the user spells it, quoted in backticks.
        value: What the user passed.
        unit: What the number counts, named in the message.
        what: The subject of the message in place of the quoted ``name``.

    Raises:
        ValueError: If ``value`` is not a number above 0.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        expected = "a positive number" if unit is None else f"a positive number of {unit}"
        raise ValueError(f"{_subject(name, what)} must be {expected}, got {value!r}.")


def _subject(name: str, what: str | None) -> str:
    """``what``, or ``name`` in backticks."""
    return f"`{name}`" if what is None else what
