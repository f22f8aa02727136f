"""Streaming fragments: how the model is cut, and which fragment syncs after which optimizer step.

With ``P`` fragments and ``H = sync_every``, a fragment lands every ``K = H / P`` optimizer steps, in turn: after step
``s`` with ``s % K == 0`` fragment ``(s / K - 1) % P`` takes its outer step. Each fragment therefore still syncs once
every ``H`` steps, but one sync moves only about ``1 / P`` of the model. With ``sync_delay = d`` the fragment's
pseudo-gradient is taken and its sum over the groups started after step ``s - d``, so ``d`` optimizer steps run while
it travels (streaming DiLoCo, arXiv 2501.18512).

Pure functions, no communication: every rank computes the same answers from the same inputs.
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning_fedshard.core.options.checks import check_positive_int


def cut_fragments(sizes: Sequence[int], num_fragments: int) -> list[list[int]]:
    """Cut units (FSDP units, in module order) into contiguous fragments balanced by size.

    Boundaries are placed where the running total comes closest to each multiple of ``total / num_fragments``, while
    every fragment keeps at least one unit.

    Args:
        sizes: Size of each unit (e.g. the numel of its local shard, equal on every rank of a group).
        num_fragments: How many fragments.

    Returns:
        The unit indices of each fragment, in order.

    Raises:
        ValueError: If there are fewer units than fragments, or ``num_fragments < 1``.
    """
    check_positive_int("fragments", num_fragments)
    if num_fragments > len(sizes):
        raise ValueError(
            f"`fragments={num_fragments}` is more than the model's {len(sizes)} FSDP unit(s): a fragment is made of"
            " whole units. Wrap more modules (e.g. one unit per decoder layer with `auto_wrap_policy`) or use fewer"
            " fragments."
        )
    total = sum(sizes)
    cumulative = [sum(sizes[: i + 1]) for i in range(len(sizes))]
    bounds: list[int] = []  # index of the first unit of fragments 1..P-1
    for k in range(1, num_fragments):
        low = (bounds[-1] if bounds else 0) + 1
        high = len(sizes) - (num_fragments - k)  # leave one unit for every later fragment
        target = total * k / num_fragments
        bounds.append(min(range(low, high + 1), key=lambda i: abs(cumulative[i - 1] - target)))
    edges = [0, *bounds, len(sizes)]
    return [list(range(edges[f], edges[f + 1])) for f in range(num_fragments)]


def fragment_interval(sync_every: int, num_fragments: int) -> int:
    """``K``: optimizer steps between two landings (of consecutive fragments)."""
    return sync_every // num_fragments


def landing_fragment(step: int, sync_every: int, num_fragments: int) -> int | None:
    """The fragment whose outer step lands after optimizer step ``step``, or ``None``."""
    interval = fragment_interval(sync_every, num_fragments)
    if step < 1 or step % interval:
        return None
    return (step // interval - 1) % num_fragments


def starting_fragment(step: int, sync_every: int, num_fragments: int, sync_delay: int) -> int | None:
    """The fragment whose pseudo-gradient is taken (and sum started) after step ``step``, when ``sync_delay > 0``."""
    if sync_delay == 0:
        return None
    return landing_fragment(step + sync_delay, sync_every, num_fragments)
