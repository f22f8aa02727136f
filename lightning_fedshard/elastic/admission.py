"""The admission check of a quorum: its groups exchange descriptions of themselves before any pseudo-gradient moves.

Each rank describes its federation, its group, whether it is joining, and what must be equal at its in-group position
in every group (model layout, sync options). A job that does not belong is refused with both values of what differs;
the others ask the lighthouse again without it. In a federation with a secret each description also carries the
proof of it, bound to the quorum and the group (an HMAC): a joining job whose secret is not the federation's (or that
has none) is refused, and the groups that hold it ask again without that job, whose sums they never take.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from lightning_fedshard.core.options.elastic import FederationEnded, FederationError, proof, proves
from lightning_fedshard.elastic.collectives import RingCollectives
from lightning_fedshard.elastic.connection import ManagerConnection
from lightning_fedshard.elastic.lighthouse import second_start
from lightning_fedshard.elastic.quorum import DESCRIPTION_BYTES, check_members, decode_description, encode_description

__all__ = ["Admission"]

log = logging.getLogger(__name__)

#: Why a joining job that does not hold the federation's secret is refused.
NO_SECRET = "it does not hold the federation's secret (or holds another one)"


class Admission:
    """The admission check of each new quorum of a connection's manager (its ranks decide together).

    Args:
        connection: The connection whose quorums are checked.
        collectives: The collectives of the sync under way (the descriptions travel on the statistics ring).
        describe: This rank's description: a JSON-able dict of what must be equal in every group at this in-group
            position; called once per new quorum.
    """

    def __init__(
        self,
        connection: ManagerConnection,
        collectives: RingCollectives,
        describe: Callable[[], Mapping[str, Any]],
    ) -> None:
        self._connection = connection
        self._collectives = collectives
        self._describe = describe
        self._checked_quorum: int | None = None
        #: The descriptions of the groups of the last quorum checked (empty if it had been checked already).
        self.descriptions: list[dict[str, Any]] = []
        #: Whether every group of the last quorum checked was joining.
        self.all_joining = False

    def forget(self) -> None:
        """Check the next quorum again, whatever its id (the manager stopped)."""
        self._checked_quorum = None

    def admits(self, ring: tuple[int, ...], joining: bool, healing: bool) -> bool:
        """Whether the groups of the quorum just taken all belong here; checked once per quorum; collective.

        Args:
            ring: The quorum's groups in ring order.
            joining: This job is joining the federation.
            healing: This group received a peer's state in this quorum.

        Returns:
            ``False`` if a job that does not belong was in this quorum: ask again without it.

        Raises:
            FederationError: If this job does not belong, naming what differs with both values.
            FederationEnded: For a standby that took a place just as its federation ended.
        """
        self.descriptions = []
        quorum_id = self._connection.rings.quorum_id
        if quorum_id == self._checked_quorum:
            return True
        if not self._exchange(ring, joining, healing):
            return False
        if not self._collectives.failed:
            self._checked_quorum = quorum_id
        return True

    def _exchange(self, ring: tuple[int, ...], joining: bool, healing: bool) -> bool:
        """Exchange descriptions over the ring; raise if this job does not belong, else tell whether all groups do."""
        connection = self._connection
        description = {
            "federation": connection.options.federation,
            "group": connection.group,
            "joining": joining or healing,
            "new": joining,  # a job joining the federation (not a group that fell behind)
            "healed_from": connection.rings.heal_source,
            "proof": self._proof(connection.group),
            **self._describe(),
        }
        mine = encode_description(description)
        everyone = torch.zeros(len(ring) * DESCRIPTION_BYTES, dtype=torch.uint8)
        if len(ring) > 1:
            self._collectives.gather_stats(everyone, mine)
        else:
            everyone.copy_(mine)
        verdict: str | None = None
        if not self._collectives.failed:  # else the sync fails anyway, is not committed, and the next quorum checks
            verdict = self._verdict([decode_description(row) for row in everyone.view(len(ring), DESCRIPTION_BYTES)])
        # One decision for the whole group (its ranks sit on different rings): refused anywhere, retry anywhere, or go.
        code = torch.tensor([{None: 0, "retry": 1}.get(verdict, 2)], dtype=torch.int64)
        dist.all_reduce(code, op=dist.ReduceOp.MAX)
        if int(code) == 2:
            self._refuse(verdict)
        return int(code) == 0

    def _proof(self, group: int | None) -> str | None:
        """This group's proof of the federation's secret in this quorum (``None`` without a secret)."""
        secret, connection = self._connection.options.federation_secret(), self._connection
        return None if secret is None else proof(secret, "admission", connection.rings.quorum_id, group)

    def _secret_verdict(self, descriptions: list[dict[str, Any]], position: int) -> str | None:
        """Whether the quorum's groups prove the secret this job holds (or none, like this job).

        Returns ``None`` if they all do; the refusal if this job is joining and the running groups (or, in a new
        federation, at least as many groups as agree with it) do not; else ``"retry"``: ask again without the jobs
        that do not (one log line each).
        """
        secret = self._connection.options.federation_secret()
        quorum = self._connection.rings.quorum_id

        def agrees(d: Mapping[str, Any]) -> bool:
            if secret is None:
                return d.get("proof") is None
            return proves(secret, d.get("proof"), "admission", quorum, d["group"])

        strangers = [d for i, d in enumerate(descriptions) if i != position and not agrees(d)]
        if not strangers:
            return None
        others = [d for i, d in enumerate(descriptions) if i != position]
        running = [d for d in others if not d["joining"]]
        if descriptions[position]["joining"]:
            outvoted = len(strangers) >= len(others) - len(strangers) + 1  # this job counts on its own side
            if (running and not any(agrees(d) for d in running)) or (not running and outvoted):
                return NO_SECRET
        for d in strangers:
            log.warning(
                f"Elastic federation {self._connection.options.federation!r}: refused the job of group {d['group']}"
                " that does not prove the federation's secret."
            )
        return "retry"

    def _verdict(self, descriptions: list[dict[str, Any]]) -> str | None:
        """``None`` if every group belongs, ``"retry"`` to ask again without a job that does not, else the refusal."""
        connection = self._connection
        position = int(connection.manager.participating_rank() or 0)
        secret_verdict = self._secret_verdict(descriptions, position)
        if secret_verdict is not None:
            self.descriptions = descriptions
            return secret_verdict
        verdict = check_members(descriptions, position)
        self.all_joining = all(d["joining"] for d in descriptions)
        self.descriptions = descriptions
        if verdict is None and connection.trained is not None and connection.rings.max_step == 0:
            # The federation's groups were alive when this job looked, and ended before it reached them.
            when = "its groups ended before this job could join them"
            address = connection.options.lighthouse_address()
            verdict = second_start(connection.trained, connection.group_index, address, when)
        return verdict

    def _refuse(self, verdict: str | None) -> None:
        """Stop the manager and raise the refusal (this rank's, or that another rank of the group was refused)."""
        connection = self._connection
        reason = verdict if verdict not in (None, "retry") else "another rank of this group was refused"
        connection.close()
        self.forget()
        if connection.options.standby and connection.trained is not None and connection.rings.max_step == 0:
            connection.group = None  # a standby that took a place just as its federation ended: it stands down
            raise FederationEnded(reason)
        if reason.startswith("This job"):
            raise FederationError(reason)
        raise FederationError(f"This job (elastic group {connection.group}) was refused: {reason}.")
