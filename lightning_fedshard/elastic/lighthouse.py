"""What a lighthouse's status page tells before a group joins: the federations it serves and whether one trained.

torchft's lighthouse has no API to list its replicas; its status page (``/status``) shows every replica that
heartbeats and the members of its last quorum with their steps. A group reads it once before its first quorum.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from urllib.parse import urlparse

#: A heartbeat line of the lighthouse's status page: ``<federation>_<group>:<uuid>: seen <seconds>s ago``.
HEARTBEAT = re.compile(r"^\s*([A-Za-z0-9.\-]+)_(\d+):[0-9a-f\-]{36}: seen ([0-9.e\-]+)s ago", re.MULTILINE)
#: A heartbeat entry with the lighthouse's own verdict: ``old`` once it is older than its heartbeat timeout.
_HEARTBEAT_ENTRY = re.compile(
    r'class="heartbeat\s*(old)?\s*">\s*([A-Za-z0-9.\-]+)_(\d+):([0-9a-f\-]{36}): seen ([0-9.e\-]+)s ago'
)
#: A member of the lighthouse's last quorum: its replica id and its step (the syncs it had committed).
_QUORUM_MEMBER = re.compile(r"<b>\s*([A-Za-z0-9.\-]+)_(\d+):[0-9a-f\-]{36}\s*</b>\s*<br/>\s*Step:\s*(\d+)")


def status_page(address: str, timeout: float = 5.0) -> str:
    """The lighthouse's status page (torchft has no other way to list its replicas); empty if it cannot be read."""
    import urllib.request

    try:
        with urllib.request.urlopen(f"{address.rstrip('/')}/status", timeout=timeout) as response:
            return str(response.read().decode(errors="replace"))
    except (OSError, ValueError):
        return ""


#: The lighthouse's own minimum quorum, shown while it has fewer participants than that.
_MIN_REPLICAS = re.compile(r"need min_replicas (\d+)")


def min_replicas(page: str) -> int | None:
    """The lighthouse's ``--min_replicas`` as its status ``page`` shows it (only while a quorum lacks participants)."""
    found = _MIN_REPLICAS.search(page)
    return int(found.group(1)) if found else None


def federations_on(page: str, recent: float = 10.0) -> dict[str, set[int]]:
    """The federations whose groups heartbeat to the lighthouse (seen in the last ``recent`` s), from its page."""
    found: dict[str, set[int]] = {}
    for name, group, age in HEARTBEAT.findall(page):
        if float(age) <= recent:
            found.setdefault(name, set()).add(int(group))
    return found


@dataclass(frozen=True)
class TrainedFederation:
    """A federation that committed syncs on a lighthouse, as its status page shows it (the lighthouse's memory)."""

    name: str
    #: The syncs its groups had committed at the lighthouse's last quorum (torchft's step).
    syncs: int
    #: The groups of that quorum.
    groups: tuple[int, ...]
    #: Its groups that still heartbeat (the lighthouse does not count them as gone).
    alive: tuple[int, ...]


def trained_federation(page: str, federation: str) -> TrainedFederation | None:
    """``federation`` if the last quorum on the lighthouse (its status ``page``) had its groups past step 0."""
    members = [(int(group), int(step)) for name, group, step in _QUORUM_MEMBER.findall(page) if name == federation]
    syncs = max((step for _, step in members), default=0)
    if syncs == 0:
        return None
    alive = {group for group, _ in live_heartbeats(page, federation)}
    return TrainedFederation(federation, syncs, tuple(sorted({g for g, _ in members})), tuple(sorted(alive)))


def live_heartbeats(page: str, federation: str, within: float | None = None) -> list[tuple[int, str]]:
    """``(group, uuid)`` of every manager of ``federation`` the lighthouse does not count as gone (not ``old``).

    Two managers of one group index (two jobs that took the same place) show as two entries with different uuids.
    With ``within``, only the managers heard from in the last ``within`` seconds (a manager that stopped a moment
    ago stays listed as live until the lighthouse's heartbeat timeout).
    """
    return [
        (int(group), uuid)
        for old, name, group, uuid, age in _HEARTBEAT_ENTRY.findall(page)
        if name == federation and not old and (within is None or float(age) <= within)
    ]


def gone_from(
    page: str, federation: str, groups: Iterable[int], managers: Mapping[int, str] | None = None
) -> tuple[int, ...]:
    """Of ``groups``, those the lighthouse (its status ``page``) counts as gone: their manager is listed ``old``.

    ``managers``: by group, the uuid of the manager that took part (the quorum's replica ids): only that manager
    counts, so that a standby taking a hung group's place (a new, live manager of the same index) does not make the
    hung one look alive. A group without one counts as gone once every manager of it is ``old``. A manager or group
    the page does not list at all (a restarted lighthouse that has not heard from it yet, or an empty page) is not
    counted as gone.
    """
    entries = [
        (int(g), uuid, bool(old)) for old, name, g, uuid, _ in _HEARTBEAT_ENTRY.findall(page) if name == federation
    ]
    managers = managers or {}

    def gone(group: int) -> bool:
        mine = [old for g, uuid, old in entries if g == group and managers.get(group, uuid) == uuid]
        return bool(mine) and all(mine)

    return tuple(g for g in groups if gone(g))


def managers_of(replica_ids: Iterable[str], federation: str) -> dict[int, str]:
    """``{group: manager uuid}`` from a quorum's replica ids (``<federation>_<group>:<uuid>``)."""
    found = {}
    for replica in replica_ids:
        name, _, uuid = replica.partition(":")
        match = re.fullmatch(rf"{re.escape(federation)}_(\d+)", name)
        if match and uuid:
            found[int(match.group(1))] = uuid.split(":")[0]
    return found


@dataclass(frozen=True)
class Vacancies:
    """What a standby group reads on the lighthouse: whether its federation trains, and the places free in it."""

    #: The planned group indices with no live group (dead, hung, finished or not started), lowest first.
    free: tuple[int, ...]
    #: Whether the federation committed syncs and none of its groups is alive any more (it ended or failed).
    ended: bool


def vacancies(page: str, federation: str, num_groups: int) -> Vacancies:
    """The places a standby may take in ``federation`` (planned for ``num_groups``), from the lighthouse's ``page``.

    A place is free only once the federation trains (it committed a sync): before, a group that is not there yet is
    still starting.
    """
    trained = trained_federation(page, federation)
    if trained is None:
        return Vacancies((), ended=False)
    if not trained.alive:
        return Vacancies((), ended=True)
    return Vacancies(tuple(g for g in range(num_groups) if g not in trained.alive), ended=False)


def second_start(trained: TrainedFederation, group: int, address: str, when: str) -> str:
    """Why a job that holds no state of ``trained`` must not start it again from step 0 on the same lighthouse."""
    return (
        f"This job (elastic group {group}) was refused: federation {trained.name!r} already trained on the lighthouse"
        f" at {address} (groups {list(trained.groups)} had committed {trained.syncs} sync(s) at its last quorum) and"
        f" {when}: this job would silently start a second federation {trained.name!r} from step 0 on fresh weights."
        " To train a new federation, start a new lighthouse or give it another name (`Elastic(federation=...)`);"
        " to go on with this one, restart its groups from their checkpoints."
    )


def reachable(address: str, timeout: float = 2.0) -> bool:
    """Whether something listens at ``address`` (``http://host:port``)."""
    import socket

    parsed = urlparse(address if "://" in address else f"http://{address}")
    try:
        with socket.create_connection((parsed.hostname or "localhost", parsed.port or 29510), timeout=timeout):
            return True
    except OSError:
        return False


__all__ = [
    "HEARTBEAT",
    "TrainedFederation",
    "Vacancies",
    "federations_on",
    "gone_from",
    "live_heartbeats",
    "managers_of",
    "min_replicas",
    "reachable",
    "second_start",
    "status_page",
    "trained_federation",
    "vacancies",
]


def refusal_on(page: str, address: str, federation: str, group: int | None, num_groups: int | None) -> str | None:
    """Why a group of ``federation`` may not use the lighthouse whose status ``page`` this is; ``None``: it may.

    A lighthouse that waits for more groups per quorum than the federation plans (no sync could ever run), or that
    serves another federation (groups of two federations would take turns in its quorums, each syncing with whoever
    asked at the same moment).
    """
    needed = min_replicas(page)
    if num_groups is not None and needed is not None and needed > num_groups:
        return (
            f"The lighthouse at {address} waits for {needed} groups per sync (its `--min_replicas {needed}`), and"
            f" this federation plans `num_groups={num_groups}`: no sync could ever run. Start the lighthouse"
            f" with `--min_replicas` at most {num_groups} (the same as `Elastic(min_groups=...)`)."
        )
    others = {name: groups for name, groups in federations_on(page).items() if name != federation}
    if others:
        listed = "; ".join(f"{name!r} (groups {sorted(groups)})" for name, groups in sorted(others.items()))
        return (
            f"This job (elastic group {group}) was refused: the lighthouse at {address} serves another"
            f" federation: {listed}, and this job belongs to federation {federation!r}. Give each"
            " federation a lighthouse of its own, or the same `Elastic(federation=...)` to every group of one."
        )
    return None
