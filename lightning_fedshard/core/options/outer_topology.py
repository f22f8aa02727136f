"""Which groups average together at a sync: the outer topology.

``"all"`` (the default) averages every group with every group at every sync. :class:`Hierarchical` averages
consecutive groups (a *site*) often and the whole federation rarely, as torch's ``HierarchicalModelAverager`` does for
DDP ranks: ``levels`` maps a period in optimizer steps to the number of consecutive groups averaged together at that
period; at a step, the largest period that divides it decides. A level below the whole federation takes the plain
mean of its groups' weights; the outer optimizer steps where the whole federation meets (the level that spans every
group), on the pseudo-gradients of weights that the site levels have averaged in between. The anchor and the outer
optimizer state therefore stay identical in every group.

A :class:`Mixing` topology applies any doubly-stochastic matrix ``W`` (rows and columns sum to 1) at each sync: group
``i`` takes ``sum_j W_ij theta_j``, receiving only from the groups ``j`` with ``W_ij > 0``. The groups' mean is
preserved and their distance from it shrinks like the second-largest eigenvalue of ``W``. :class:`Gossip` (each group
with ``peers`` seeded partners) and :class:`Sampled` (a seeded sample of groups averages among themselves, the others
keep training) are mixings. These topologies take plain means (``"fedavg"``); the groups differ between syncs, their
consensus is the exact mean, and the end of training averages every group. ``Sampled(..., outer_step=True)`` is no mix:
the sample's pseudo-gradients make the federation's outer step, from whose anchor every group restarts.

This module knows nothing about Lightning; it is a schedule.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from torch import Tensor

from lightning_fedshard.core.options.checks import check_positive_int
from lightning_fedshard.core.options.class_names import named_class, required_arguments

#: How far from 1 a row or column sum of a mixing matrix may be.
STOCHASTIC_TOLERANCE = 1e-6

#: The names of the outer topologies that need no parameters.
OUTER_TOPOLOGY_NAMES: tuple[str, ...] = ("all",)

#: Rounds of a ``Mixing`` schedule (a callable) whose matrices must, together, connect every group.
CONNECTIVITY_ROUNDS = 256


class Hierarchical:
    """Consecutive groups average every few steps, the whole federation at the largest period.

    Args:
        levels: ``{period: groups}``: every ``period`` optimizer steps, blocks of ``groups`` consecutive groups (group
            indices ``0 .. groups-1``, ``groups .. 2 groups-1``, ...) average their weights; at a step the largest
            period that divides it decides. The level of the largest period must span every group; every period must
            be a multiple of ``sync_every`` and every block size must divide the number of groups (checked when the
            strategy knows them). E.g. ``{8: 2, 32: 4}`` on 4 groups: sites of 2 groups every 8 steps, everyone every
            32.
        sites: Which groups form a site, when they are not consecutive: a list of sites, each a list of group
            indices, every group in exactly one site and every site of the same size, which must be the block size of
            a level (e.g. ``[[0, 2], [1, 3]]`` with ``{8: 2, 32: 4}``). The listed sites are that level's blocks; every
            level's blocks are consecutive in the order the groups are listed, so smaller blocks nest inside a site
            and larger ones join whole sites. ``None``: groups ``0 .. G-1`` in order.

    Raises:
        ValueError: For no level, a period or block size that is not a positive integer, two levels of one size, or
            sites that are empty, of unequal sizes or of a size no level averages.
    """

    def __init__(self, levels: Mapping[int, int], sites: Sequence[Sequence[int]] | None = None) -> None:
        if not isinstance(levels, Mapping) or not levels:
            raise ValueError(f"`levels` must map periods to numbers of groups, e.g. {{8: 2, 32: 4}}, got {levels!r}.")
        parsed = {}
        for period, groups in levels.items():
            for name, value in (("period", period), ("number of groups", groups)):
                check_positive_int(name, value, what=f"Every {name} of `levels={dict(levels)}`")
            parsed[period] = groups
        sizes = list(parsed.values())
        if len(set(sizes)) != len(sizes):
            raise ValueError(f"Two levels of `levels={levels}` average the same number of groups.")
        self.levels: dict[int, int] = dict(sorted(parsed.items()))
        self.sites: tuple[tuple[int, ...], ...] | None = None if sites is None else self._check_sites(sites)

    def _check_sites(self, sites: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
        if isinstance(sites, (str, bytes)) or not sites or any(isinstance(s, (str, bytes)) or not s for s in sites):
            raise ValueError(f"`sites` must be a list of non-empty lists of group indices, got {sites!r}.")
        parsed = tuple(tuple(site) for site in sites)
        for site in parsed:
            for group in site:
                if isinstance(group, bool) or not isinstance(group, int) or group < 0:
                    raise ValueError(f"Every group of `sites` must be an index >= 0, got {group!r} in {sites!r}.")
        sizes = {len(site) for site in parsed}
        if len(sizes) != 1:
            raise ValueError(
                f"Every site of `sites={sites!r}` must hold the same number of groups, got {sorted(sizes)}."
            )
        (size,) = sizes
        if size not in self.levels.values():
            raise ValueError(
                f"The sites of `sites={sites!r}` hold {size} groups each, but no level of `levels={self.levels}`"
                f" averages {size} groups."
            )
        return parsed

    def __eq__(self, other: object) -> bool:
        if type(self) is not type(other):
            return False
        return (self.levels, self.sites) == (other.levels, other.sites)  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((tuple(self.levels.items()), self.sites))

    def __repr__(self) -> str:
        sites = "" if self.sites is None else f", sites={[list(site) for site in self.sites]}"
        return f"Hierarchical(levels={self.levels}{sites})"

    def describe(self) -> str:
        """E.g. ``"hierarchical: 2 groups every 8 steps, 4 every 32"``."""
        parts = [f"{groups} groups every {period} steps" for period, groups in self.levels.items()]
        sites = "" if self.sites is None else f" (sites {[list(site) for site in self.sites]})"
        return "hierarchical: " + ", ".join(parts) + sites

    def order(self, num_groups: int) -> tuple[int, ...]:
        """The groups in the order whose consecutive runs form every level's blocks."""
        if self.sites is None:
            return tuple(range(num_groups))
        return tuple(group for site in self.sites for group in site)

    def blocks(self, size: int, num_groups: int) -> tuple[tuple[int, ...], ...]:
        """The blocks of ``size`` groups that average together at that level, in :meth:`order`."""
        order = self.order(num_groups)
        return tuple(order[start : start + size] for start in range(0, num_groups, size))

    def site_blocks(self, num_groups: int) -> dict[int, tuple[tuple[int, ...], ...]]:
        """By block size below the whole federation, that level's blocks (each needs process groups of its own)."""
        return {size: self.blocks(size, num_groups) for size in self.site_sizes(num_groups)}

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
        """Raise ``ValueError`` unless the blocks fit ``num_groups`` and the federation meets.

        The blocks must divide the groups, the level of the largest period must span them all, and the sites, if
        given, must hold every group exactly once.
        """
        if self.sites is not None and sorted(self.order(num_groups)) != list(range(num_groups)):
            raise ValueError(
                f"`outer_topology={self!r}`: the sites must hold every one of the {num_groups} groups"
                f" (0 .. {num_groups - 1}) exactly once."
            )
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


MatrixSpec = Sequence[Sequence[float]] | Tensor


class Mixing:
    """Every sync, group ``i`` takes ``sum_j W_ij theta_j`` for a doubly-stochastic ``W`` (module docstring).

    Args:
        matrix: The ``G x G`` matrix (nested lists or a tensor), the same at every sync, or a callable that returns
            the matrix of sync ``round`` (counted from 0; the sync after optimizer step ``(round + 1) sync_every``).

    Raises:
        ValueError: For a fixed matrix that is not square, has a negative entry, a row or column that does not sum
            to 1 (within 1e-6), or groups that never meet (the graph of its nonzero off-diagonal weights is not
            connected: the identity, or a block-diagonal matrix).
    """

    def __init__(self, matrix: MatrixSpec | Callable[[int], MatrixSpec]) -> None:
        self.matrix = matrix
        if not callable(matrix):
            fixed = check_doubly_stochastic(_as_matrix(matrix), "`Mixing(matrix)`")
            check_connected(fixed != 0, "`Mixing(matrix)`")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.matrix!r})"

    def describe(self) -> str:
        """A short name for logs."""
        return "mixing matrix"

    def weights(self, round: int, num_groups: int) -> Tensor:
        """The float64 ``G x G`` matrix of sync ``round``, checked.

        Raises:
            ValueError: If it is not doubly stochastic or not ``num_groups x num_groups``.
        """
        spec = self.matrix(round) if callable(self.matrix) else self.matrix
        matrix = _as_matrix(spec)
        if matrix.shape != (num_groups, num_groups):
            raise ValueError(
                f"The mixing matrix of round {round} is {tuple(matrix.shape)}, the job has {num_groups} groups."
            )
        return check_doubly_stochastic(matrix, f"the mixing matrix of round {round}")

    def check_groups(self, num_groups: int) -> None:
        """Raise ``ValueError`` unless the matrices fit ``num_groups`` groups and let every group meet every other.

        A fixed matrix was checked when it was given; for a schedule (a callable), the groups that the first
        :data:`CONNECTIVITY_ROUNDS` rounds mix, taken together, must connect every group.
        """
        meets = self.weights(0, num_groups) != 0
        for round in range(1, CONNECTIVITY_ROUNDS if callable(self.matrix) else 1):
            if len(components(meets)) == 1:
                return
            meets |= self.weights(round, num_groups) != 0
        name = f"`Mixing({self.matrix!r})`, rounds 0 to {CONNECTIVITY_ROUNDS - 1} together,"
        check_connected(meets, name if callable(self.matrix) else "`Mixing(matrix)`")


class Gossip(Mixing):
    """Every sync, each group averages with ``peers`` partners drawn from a seeded schedule every rank computes alike.

    Round ``r`` draws ``peers`` random pairings of the groups (a generator seeded with ``seed`` and ``r``); with ``P_k``
    the permutation that swaps each pair (a group left over with an odd count stays), ``W = (I + sum_k P_k) /
    (peers + 1)``: symmetric and doubly stochastic.

    Args:
        peers: Partners per group and sync (at least 1, fewer than the groups).
        seed: Seed of the schedule.
    """

    def __init__(self, peers: int = 1, seed: int = 0) -> None:
        check_positive_int("peers", peers)
        self.peers, self.seed = peers, seed  # the matrix of a round is drawn by `weights`

    def __repr__(self) -> str:
        return f"Gossip(peers={self.peers}, seed={self.seed})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Gossip) and (self.peers, self.seed) == (other.peers, other.seed)

    def __hash__(self) -> int:
        return hash(("gossip", self.peers, self.seed))

    def describe(self) -> str:
        """E.g. ``"gossip with 1 peer per sync"``."""
        return f"gossip with {self.peers} peer(s) per sync"

    def check_groups(self, num_groups: int) -> None:
        """Raise ``ValueError`` with more peers than other groups."""
        if self.peers >= num_groups:
            raise ValueError(
                f"`Gossip(peers={self.peers})` needs more than {self.peers} groups, the job has {num_groups}."
            )

    def weights(self, round: int, num_groups: int) -> Tensor:
        """``(I + sum_k P_k) / (peers + 1)`` of round ``round``."""
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + round)
        matrix = torch.eye(num_groups, dtype=torch.float64)
        for _ in range(self.peers):
            order = torch.randperm(num_groups, generator=generator).tolist()
            swap = torch.eye(num_groups, dtype=torch.float64)
            for a, b in zip(order[0::2], order[1::2]):
                swap[[a, b]] = swap[[b, a]]
            matrix += swap
        return matrix / (self.peers + 1)


class Sampled(Mixing):
    """Every sync, a seeded sample of ``groups_per_round`` groups averages: among themselves, or into the outer step.

    By default (``outer_step=False``) the sampled groups replace their weights by their plain mean and the others keep
    training (a mixing, gossip-like). With ``outer_step=True`` it is sampled participation as FedAvg and Photon run
    it: at each round the anchor takes the outer step (any outer optimizer, Nesterov included) on the mean
    pseudo-gradient of the round's sampled groups only, and *every* group restarts from the new anchor; the groups not
    sampled take part in the collective but add nothing. The end of training is one outer step on every group's
    pseudo-gradient, so the run ends on the consensus, the anchor.

    Round ``r`` is the ``r``-th (from 0) ``sync_every``-step period: a landing after optimizer step ``s`` belongs to
    round ``(s - 1) // sync_every``, so with one fragment round ``r`` lands after step ``(r + 1) sync_every``, and
    with ``fragments = P`` every fragment lands once per round with the same sample.

    Args:
        groups_per_round: Groups that take part in each sync (at most the groups; at least 2 for a mix, 1 with
            ``outer_step=True``).
        seed: Seed of the schedule.
        outer_step: Sampled participation in the federation's outer step (see above) instead of a mix.
    """

    def __init__(self, groups_per_round: int, seed: int = 0, outer_step: bool = False) -> None:
        if not isinstance(outer_step, bool):
            raise ValueError(f"`outer_step` must be True or False, got `outer_step={outer_step!r}`.")
        check_positive_int("groups_per_round", groups_per_round, minimum=1 if outer_step else 2)
        self.groups_per_round, self.seed = groups_per_round, seed  # the matrix of a round is drawn by `weights`
        self.outer_step = outer_step

    def __repr__(self) -> str:
        outer_step = ", outer_step=True" if self.outer_step else ""
        return f"Sampled(groups_per_round={self.groups_per_round}, seed={self.seed}{outer_step})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sampled) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(("sampled", *self._key()))

    def _key(self) -> tuple[int, int, bool]:
        return self.groups_per_round, self.seed, self.outer_step

    def describe(self) -> str:
        """E.g. ``"2 sampled groups per sync"``, ``"2 sampled groups per outer step"``."""
        return f"{self.groups_per_round} sampled groups per {'outer step' if self.outer_step else 'sync'}"

    def check_groups(self, num_groups: int) -> None:
        """Raise ``ValueError`` with more groups per round than groups."""
        if self.groups_per_round > num_groups:
            raise ValueError(
                f"`Sampled(groups_per_round={self.groups_per_round})` samples more groups than the job's {num_groups}."
            )

    def sample(self, round: int, num_groups: int) -> list[int]:
        """The groups of round ``round``, ascending."""
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + round)
        return sorted(torch.randperm(num_groups, generator=generator)[: self.groups_per_round].tolist())

    def weights(self, round: int, num_groups: int) -> Tensor:
        """``1 / k`` among the sampled groups, the identity for the others."""
        matrix = torch.eye(num_groups, dtype=torch.float64)
        chosen = self.sample(round, num_groups)
        for i in chosen:
            matrix[i, i] = 0.0
            matrix[i, chosen] = 1.0 / len(chosen)
        return matrix


def _as_matrix(spec: MatrixSpec) -> Tensor:
    matrix = torch.as_tensor(spec, dtype=torch.float64)
    if matrix.dim() != 2 or matrix.shape[0] != matrix.shape[1]:
        raise ValueError(f"A mixing matrix must be square, got shape {tuple(matrix.shape)}.")
    return matrix


def check_doubly_stochastic(matrix: Tensor, name: str) -> Tensor:
    """``matrix`` if it has no negative entry and every row and column sums to 1 (within 1e-6).

    Raises:
        ValueError: Naming the offending row or column and its sum.
    """
    if (matrix < 0).any():
        raise ValueError(f"{name} has a negative entry: {matrix.min().item():g}.")
    for axis, label in ((1, "row"), (0, "column")):
        sums = matrix.sum(dim=axis)
        bad = (sums - 1).abs() > STOCHASTIC_TOLERANCE
        if bad.any():
            index = int(bad.nonzero()[0])
            raise ValueError(f"{name} is not doubly stochastic: {label} {index} sums to {sums[index].item():g}.")
    return matrix


def components(meets: Tensor) -> list[list[int]]:
    """The groups that meet, directly or through others: the connected parts of the graph of ``meets[i, j]``."""
    part = list(range(meets.shape[0]))

    def root(i: int) -> int:
        while part[i] != i:
            part[i] = part[part[i]]
            i = part[i]
        return i

    for i, j in meets.nonzero().tolist():
        part[root(i)] = root(j)
    parts: dict[int, list[int]] = {}
    for i in range(len(part)):
        parts.setdefault(root(i), []).append(i)
    return list(parts.values())


def check_connected(meets: Tensor, name: str) -> None:
    """Raise ``ValueError`` if the groups fall apart into parts that never exchange weights.

    Args:
        meets: ``G x G`` booleans: whether group ``i`` takes a share of group ``j``'s weights.
        name: The matrix, for the message.
    """
    parts = components(meets)
    if len(parts) > 1:
        raise ValueError(
            f"{name} never lets the groups {parts} meet: the graph of its nonzero off-diagonal weights is not"
            f" connected, so these {len(parts)} parts would train apart and only meet at the end. Give weights that"
            " connect every group (e.g. a ring), or use `Gossip(peers=1)`."
        )


OuterTopologySpec = str | Hierarchical | Mixing

#: The classes an ``outer_topology`` given as a bare class name (``"Gossip"``) may refer to.
OUTER_TOPOLOGY_CLASSES: tuple[type, ...] = (Hierarchical, Mixing, Gossip, Sampled)

#: How to give each class's required arguments, as a command line would (argument, value).
_EXAMPLE_ARGUMENTS: dict[type, tuple[str, str]] = {
    Hierarchical: ("levels", "'{8: 2, 32: 4}'"),
    Mixing: ("matrix", "'[[0.5, 0.5], [0.5, 0.5]]'"),
    Sampled: ("groups_per_round", "2"),
}


def resolve_outer_topology(spec: OuterTopologySpec) -> Hierarchical | Mixing | None:
    """``None`` for ``"all"``, the topology object otherwise.

    A class given by its path or name alone (``"lightning_fedshard.Gossip"``, ``"Gossip"``), as a command line or YAML
    gives it without init arguments, is that class with its default arguments.

    Raises:
        ValueError: For anything else, or a class path alone for a class with required arguments (naming them and
            how to give them).
    """
    if isinstance(spec, (Hierarchical, Mixing)):
        return spec
    if spec in OUTER_TOPOLOGY_NAMES:
        return None
    cls = named_class(spec, (Hierarchical, Mixing), OUTER_TOPOLOGY_CLASSES) if isinstance(spec, str) else None
    if cls is not None:
        return _with_defaults(spec, cls)
    raise ValueError(
        f"Unknown `outer_topology={spec!r}`; use 'all', `lightning_fedshard.Hierarchical(levels={{8: 2, 32: 4}})`,"
        " `Gossip(peers=1)`, `Sampled(groups_per_round=2)` or `Mixing(matrix)`."
    )


def _with_defaults(path: str, cls: type) -> Hierarchical | Mixing:
    """``cls()`` for a class given by its path alone; for a class with required arguments, how to give them.

    Raises:
        ValueError: Naming the required arguments and the command-line, YAML and Python forms that give them.
    """
    required = required_arguments(cls)
    if not required:
        return cls()
    name, value = _EXAMPLE_ARGUMENTS.get(cls, (required[0], "..."))
    full = path if "." in path else f"lightning_fedshard.{cls.__name__}"
    option, python_value = "--trainer.strategy.outer_topology", value.strip("'")
    raise ValueError(
        f"`outer_topology={path!r}` needs {', '.join(f'`{r}`' for r in required)}; a class path alone means the class"
        f" with its defaults. On a command line give them after it: `{option} {full} {option}.{name} {value}`"
        f" (`fedshard plan`: `--outer_topology {full} --outer_topology.{name} {value}`); in YAML a `class_path` with"
        f" `init_args`; in Python `{cls.__name__}({name}={python_value})`."
    )


__all__ = [
    "CONNECTIVITY_ROUNDS",
    "OUTER_TOPOLOGY_NAMES",
    "Gossip",
    "Hierarchical",
    "Mixing",
    "OuterTopologySpec",
    "Sampled",
    "check_connected",
    "check_doubly_stochastic",
    "components",
    "resolve_outer_topology",
]
