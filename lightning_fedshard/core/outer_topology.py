"""Which groups average together at a sync: the outer topology.

``"all"`` (the default) averages every group with every group at every sync. :class:`Hierarchical` averages
consecutive groups (a *site*) often and the whole federation rarely, as torch's ``HierarchicalModelAverager`` does for
DDP ranks: ``levels`` maps a period in optimizer steps to the number of consecutive groups averaged together at that
period; at a step, the largest period that divides it decides. A level below the whole federation takes the plain
mean of its groups' weights; the outer optimizer steps where the whole federation meets (the level that spans every
group), on the pseudo-gradients of weights that the site levels have averaged in between. The anchor and the outer
optimizer state therefore stay identical in every group.

This module knows nothing about Lightning; it is a schedule.
"""

from __future__ import annotations

from collections.abc import Mapping

#: The names of the outer topologies that need no parameters.
OUTER_TOPOLOGY_NAMES: tuple[str, ...] = ("all",)


class Hierarchical:
    """Consecutive groups average every few steps, the whole federation at the largest period.

    Args:
        levels: ``{period: groups}``: every ``period`` optimizer steps, blocks of ``groups`` consecutive groups (group
            indices ``0 .. groups-1``, ``groups .. 2 groups-1``, ...) average their weights; at a step the largest
            period that divides it decides. The level of the largest period must span every group; every period must
            be a multiple of ``sync_every`` and every block size must divide the number of groups (checked when the
            strategy knows them). E.g. ``{8: 2, 32: 4}`` on 4 groups: sites of 2 groups every 8 steps, everyone every
            32.

    Raises:
        ValueError: For no level, a period or block size that is not a positive integer, or two levels of one size.
    """

    def __init__(self, levels: Mapping[int, int]) -> None:
        if not isinstance(levels, Mapping) or not levels:
            raise ValueError(f"`levels` must map periods to numbers of groups, e.g. {{8: 2, 32: 4}}, got {levels!r}.")
        parsed = {}
        for period, groups in levels.items():
            for name, value in (("period", period), ("number of groups", groups)):
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise ValueError(f"Every {name} of `levels` must be a positive integer, got {value!r} in {levels}.")
            parsed[period] = groups
        sizes = list(parsed.values())
        if len(set(sizes)) != len(sizes):
            raise ValueError(f"Two levels of `levels={levels}` average the same number of groups.")
        self.levels: dict[int, int] = dict(sorted(parsed.items()))

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and self.levels == other.levels  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash(tuple(self.levels.items()))

    def __repr__(self) -> str:
        return f"Hierarchical(levels={self.levels})"

    def describe(self) -> str:
        """E.g. ``"hierarchical: 2 groups every 8 steps, 4 every 32"``."""
        parts = [f"{groups} groups every {period} steps" for period, groups in self.levels.items()]
        return "hierarchical: " + ", ".join(parts)

    def block_size(self, step: int) -> int | None:
        """How many consecutive groups average after optimizer step ``step`` (``None``: no sync then)."""
        due = [period for period in self.levels if step % period == 0]
        return self.levels[max(due)] if due and step > 0 else None

    def site_sizes(self, num_groups: int) -> tuple[int, ...]:
        """The block sizes below the whole federation (each needs process groups of its own)."""
        return tuple(size for size in self.levels.values() if size < num_groups)

    def check_sync_every(self, sync_every: int) -> None:
        """Raise ``ValueError`` unless every period is a multiple of ``sync_every``."""
        wrong = [period for period in self.levels if period % sync_every]
        if wrong:
            raise ValueError(
                f"The periods {wrong} of `outer_topology={self!r}` are not multiples of `sync_every={sync_every}`."
            )

    def check_groups(self, num_groups: int) -> None:
        """Raise ``ValueError`` unless the blocks divide ``num_groups`` and the largest period spans them all."""
        for period, groups in self.levels.items():
            if num_groups % groups:
                raise ValueError(
                    f"`outer_topology={self!r}`: blocks of {groups} consecutive groups (period {period}) do not divide"
                    f" the {num_groups} groups."
                )
        top = self.levels[max(self.levels)]
        if top != num_groups:
            raise ValueError(
                f"`outer_topology={self!r}`: the level of the largest period ({max(self.levels)} steps) averages {top}"
                f" groups; it must span all {num_groups} groups, so that the federation meets."
            )


OuterTopologySpec = str | Hierarchical


def resolve_outer_topology(spec: OuterTopologySpec) -> Hierarchical | None:
    """``None`` for ``"all"``, the :class:`Hierarchical` itself otherwise.

    Raises:
        ValueError: For anything else.
    """
    if isinstance(spec, Hierarchical):
        return spec
    if spec in OUTER_TOPOLOGY_NAMES:
        return None
    raise ValueError(
        f"Unknown `outer_topology={spec!r}`; use 'all' or `lightning_fedshard.Hierarchical(levels={{8: 2, 32: 4}})`."
    )


__all__ = ["OUTER_TOPOLOGY_NAMES", "Hierarchical", "OuterTopologySpec", "resolve_outer_topology"]
