"""The shared checks of user input (core.checks): what they accept and the messages they raise."""

from __future__ import annotations

import pytest

from lightning_fedshard.core.options.checks import check_positive_int, check_positive_number


@pytest.mark.parametrize("value", [1, 7, 2**40])
def test_positive_int_accepts_integers_from_one(value: int) -> None:
    check_positive_int("sync_every", value)


@pytest.mark.parametrize("value", [0, -3, 2.5, 2.0, True, "4", None])
def test_positive_int_refuses_the_rest_quoting_name_and_value(value: object) -> None:
    with pytest.raises(ValueError) as error:
        check_positive_int("sync_every", value)
    assert str(error.value) == f"`sync_every` must be a positive integer, got {value!r}."


def test_positive_int_options() -> None:
    check_positive_int("num_groups", None, allow_none=True)
    check_positive_int("groups_per_round", 2, minimum=2)
    with pytest.raises(ValueError, match=r"^`groups_per_round` must be an integer of 2 or more, got 1\.$"):
        check_positive_int("groups_per_round", 1, minimum=2)
    with pytest.raises(ValueError, match=r"^Every period of `levels` must be a positive integer, got 0\.$"):
        check_positive_int("period", 0, what="Every period of `levels`")
    with pytest.raises(
        ValueError, match=r"^`Elastic\(start_groups=\.\.\.\)` must be a positive integer or None, got 0\.$"
    ):
        check_positive_int("Elastic(start_groups=...)", 0, allow_none=True, expected="a positive integer or None")


@pytest.mark.parametrize("value", [0.5, 3, 1e9])
def test_positive_number_accepts_ints_and_floats_above_zero(value: float) -> None:
    check_positive_number("timeout", value)


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), True, "3", None])
def test_positive_number_refuses_the_rest(value: object) -> None:
    with pytest.raises(ValueError) as error:
        check_positive_number("Elastic(timeout=...)", value, unit="seconds")
    assert str(error.value) == f"`Elastic(timeout=...)` must be a positive number of seconds, got {value!r}."
