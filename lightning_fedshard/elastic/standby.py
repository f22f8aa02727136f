"""A standby job: it waits until a planned group of the running federation is gone, then takes its place.

Rank 0 of the standby reads the lighthouse's status page every ``poll`` seconds (no manager runs meanwhile: a standby
is not a member of any quorum). Once the federation trains and one of its ``num_groups`` planned groups has no live
manager, every rank takes that group's index and starts its manager, which heartbeats under the group's name. The
group then joins as any new job does, at the federation's next sync, and heals from a peer. Two standbys that take
one place at once settle it by the lighthouse's heartbeats (:func:`contested`).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from typing import Any, Protocol

from lightning_fedshard.core.options.elastic import Elastic, FederationEnded
from lightning_fedshard.elastic.lighthouse import live_heartbeats, status_page, vacancies

log = logging.getLogger(__name__)

__all__ = ["contested", "free_place", "wait_for_place"]


class Claimant(Protocol):
    """What a standby needs of its communicator (an :class:`~lightning_fedshard.elastic.ElasticCommunicator`)."""

    options: Elastic

    def rank0(self, decide: Callable[[], Any]) -> Any: ...  # noqa: D102

    def take_place(self, place: int) -> None: ...  # noqa: D102

    def give_up_place(self, why: str) -> None: ...  # noqa: D102

    def manager_uuid(self) -> str: ...  # noqa: D102


def wait_for_place(claimant: Claimant, num_groups: int, poll: float = 0.5) -> int | None:
    """Wait for a free place among ``num_groups`` planned groups and take it; collective over the standby's ranks.

    Returns:
        The index taken, or ``None`` if the federation ended (it trained, and none of its groups is alive) while
        this standby waited.
    """
    federation, address = claimant.options.federation, claimant.options.lighthouse_address()
    chance = random.Random()  # not the training's seeded generator: two standbys must not draw alike

    def look() -> int | None:
        place = free_place(status_page(address), federation, num_groups)
        if place is None or place == -1:
            return place
        time.sleep(chance.uniform(0.0, 0.5))  # standbys that saw the place at once rarely take it at once
        return free_place(status_page(address), federation, num_groups)

    while True:
        place = claimant.rank0(look)
        if place == -1:
            return None
        if place is None:
            time.sleep(poll)
            continue
        try:
            claimant.take_place(place)
        except FederationEnded:
            return None
        if not claimant.rank0(lambda: contested(claimant, address, place)):
            log.info(f"Standby of federation {federation!r}: group {place} is gone, taking its place.")
            return place
        claimant.give_up_place(
            f"Standby of federation {federation!r}: another job took group {place}'s place too; this one gives it up"
            " and waits again."
        )


def contested(claimant: Claimant, address: str, place: int, beat: float = 0.3) -> bool:
    """Whether this standby gives up the place it just took because another job took it too (rank 0).

    The managers of the place heard from in the last ``beat`` seconds are its claimants. Alone, this one keeps the
    place. Otherwise the claimant with the smallest uuid may keep it, once the others are silent: a claimant that saw
    no one else kept the place before the others came, and one that is not the smallest gives it up at once (its
    manager stops, and falls silent within ``beat``).
    """
    mine = claimant.manager_uuid()

    def claimants() -> list[str]:
        live = live_heartbeats(status_page(address), claimant.options.federation, within=beat)
        return sorted(uuid for group, uuid in live if group == place)

    deadline = time.monotonic() + max(5.0, 10 * beat)
    while mine not in (found := claimants()) and time.monotonic() < deadline:
        time.sleep(0.1)  # until the lighthouse lists this manager
    time.sleep(beat)
    found = claimants()
    if found == [mine] or not found:
        return False
    if found[0] != mine:
        return True
    time.sleep(2 * beat)
    return claimants() != [mine]


def free_place(page: str, federation: str, num_groups: int) -> int | None:
    """The place a standby takes now: the lowest free group index, ``-1`` if the federation ended, else ``None``."""
    found = vacancies(page, federation, num_groups)
    if found.ended:
        return -1
    return found.free[0] if found.free else None
