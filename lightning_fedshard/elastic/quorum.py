"""What the groups of a quorum tell each other: their descriptions, who is admitted, and who joined, healed or left.

At every new quorum each rank sends its fed ring a short description of its group (federation name, group index,
whether it is joining, model layout and sync options, as JSON in a fixed-size buffer). :func:`check_members` decides
from them whether every group belongs to one federation; :func:`membership_change` tells what changed since the
previous quorum.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lightning_fedshard.core.options.elastic import FederationError

#: Bytes of one group's description on the wire (JSON, zero padded).
DESCRIPTION_BYTES = 2048


def encode_description(description: Mapping[str, Any]) -> Tensor:
    """``description`` as JSON in a zero-padded ``uint8`` tensor of :data:`DESCRIPTION_BYTES`.

    Raises:
        FederationError: If it does not fit.
    """
    encoded = json.dumps(description, sort_keys=True, default=str).encode()
    if len(encoded) > DESCRIPTION_BYTES:
        raise FederationError(f"This group's description is too long to exchange ({len(encoded)} bytes).")
    row = torch.zeros(DESCRIPTION_BYTES, dtype=torch.uint8)
    row[: len(encoded)] = torch.frombuffer(bytearray(encoded), dtype=torch.uint8)
    return row


def decode_description(row: Tensor) -> dict[str, Any]:
    """A description from :func:`encode_description`; a row of zeros (a peer that sent nothing) is a joining one."""
    data = bytes(row.tolist()).rstrip(b"\0")
    return json.loads(data.decode()) if data else {"federation": None, "group": -1, "joining": True}


def check_members(descriptions: list[dict[str, Any]], position: int) -> str | None:
    """Whether every group of a quorum belongs to one federation.

    Returns ``None`` if so, ``"retry"`` if another group does not, or the reason this rank's group (at ring
    ``position``) is refused.

    The groups already training (not joining) define the federation; when every group is joining, the most common
    description does (the first in ring order among equally common ones). A group whose description differs is refused;
    so is a joining group whose index a running group already has (or, among joining groups, a later one in ring order).
    """
    comparable = [_comparable(d) for d in descriptions]
    keys = [json.dumps(c, sort_keys=True) for c in comparable]
    running = [k for k, d in zip(keys, descriptions) if not d["joining"]]
    if running:
        pool = running
    else:  # everyone is joining: the most common federation name first, then the most common description under it
        names = [d["federation"] for d in descriptions]
        name = max(names, key=lambda n: (names.count(n), -names.index(n)))
        pool = [k for k, d in zip(keys, descriptions) if d["federation"] == name]
    reference_key = max(pool, key=lambda k: (pool.count(k), -pool.index(k)))
    reference, mine = json.loads(reference_key), comparable[position]
    if keys[position] != reference_key:
        differences = [
            f"{name} {mine.get(name)!r} here, {reference.get(name)!r} in the federation"
            for name in sorted(set(reference) | set(mine))
            if mine.get(name) != reference.get(name)
        ]
        return f"it does not belong to the federation it reached ({'; '.join(differences)})"
    group = descriptions[position]["group"]
    holders = [i for i, d in enumerate(descriptions) if d["group"] == group]
    keeper = next((i for i in holders if not descriptions[i]["joining"]), holders[0])
    if position != keeper:
        return f"group {group} is already running in federation {mine['federation']!r}"
    if any(k != reference_key for k in keys) or len({d["group"] for d in descriptions}) < len(descriptions):
        return "retry"
    return None


def _comparable(description: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in description.items() if k not in ("group", "joining", "new", "healed_from", "proof")}


@dataclass(frozen=True)
class MembershipChange:
    """Groups that joined, healed or left at one quorum, as one group saw them.

    Args:
        federation: The federation's name.
        group: The group that saw it (this job).
        groups: The groups of the quorum, in ring order.
        joined: Groups that entered the federation (a new job, or every group of a new federation).
        healed: Groups of the previous quorum that were behind and took a peer's state.
        left: Groups of the previous quorum that are gone (they failed, hung or ended).
        healed_from: For the groups that took a peer's state, that peer's group (rank 0's source: the ranks of one
            group may heal from different peers).
    """

    federation: str
    group: int
    groups: tuple[int, ...]
    joined: tuple[int, ...] = ()
    healed: tuple[int, ...] = ()
    left: tuple[int, ...] = ()
    healed_from: Mapping[int, int] = field(default_factory=dict)

    def lines(self, step: int) -> list[str]:
        """One line per group that joined, healed or left, at optimizer step ``step``."""
        where, now = f"Elastic federation {self.federation!r} at step {step}", f"groups now {list(self.groups)}"

        def who(g: int) -> str:
            return f"group {g} (this job)" if g == self.group else f"group {g}"

        def source(g: int) -> str:
            return f" from group {self.healed_from[g]}" if g in self.healed_from else ""

        return (
            [f"{where}: {who(g)} joined{', healed' + source(g) if source(g) else ''}; {now}." for g in self.joined]
            + [f"{where}: {who(g)} was behind and healed{source(g)}; {now}." for g in self.healed]
            + [f"{where}: {who(g)} left; {now}." for g in self.left]
        )


def membership_change(
    federation: str,
    group: int,
    previous: tuple[int, ...],
    groups: tuple[int, ...],
    descriptions: list[dict[str, Any]],
) -> MembershipChange | None:
    """What changed between two quorums, from their groups and the descriptions exchanged at the second one.

    A group that was not in ``previous`` joined (for a job's first quorum, ``previous`` is empty: only the groups
    joining with it joined), and so did a new job that took the index of a group of ``previous`` (it replaced a
    failed one before the others noticed); another group of ``previous`` that describes itself as joining was behind
    and healed.

    Returns:
        ``None`` if no group joined, healed or left.
    """
    described = {int(d["group"]): d for d in descriptions if isinstance(d.get("group"), int) and d["group"] >= 0}
    joining = {g for g, d in described.items() if d.get("joining")}
    new = {g for g, d in described.items() if d.get("new")}
    joined = tuple(
        g
        for g in groups
        if (g in previous and g in new) or (g not in previous and (previous or g in joining or g == group))
    )
    healed = tuple(g for g in groups if g in previous and g in joining and g not in new)
    left = tuple(g for g in previous if g not in groups)
    if not (joined or healed or left):
        return None
    sources = {g: int(d["healed_from"]) for g, d in described.items() if d.get("healed_from") is not None}
    return MembershipChange(federation, group, groups, joined, healed, left, sources)


__all__ = [
    "DESCRIPTION_BYTES",
    "MembershipChange",
    "check_members",
    "decode_description",
    "encode_description",
    "membership_change",
]
