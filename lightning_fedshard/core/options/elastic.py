"""The options of an elastic federation, and the error that ends one.

In an elastic federation each group is a job of its own, and the groups meet through a lighthouse that decides which
groups take part in each sync; a group that starts late or fell behind takes the federation's state from a peer.
:class:`Elastic` holds the options; :mod:`lightning_fedshard.elastic` runs them (``pip install
lightning-fedshard[elastic]``). This module imports nothing beyond the standard library.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from dataclasses import dataclass, field
from typing import ClassVar
from urllib.parse import urlparse

from lightning_fedshard.core.options.checks import check_positive_int, check_positive_number
from lightning_fedshard.core.options.refusal import Refusal

#: Environment variables read when :class:`Elastic` leaves a value unset.
GROUP_ENV = "FEDSHARD_GROUP"
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
SECRET_ENV = "FEDSHARD_SECRET"
#: Fewest characters of a federation secret (16 random hex digits are 64 bits).
MIN_SECRET_LENGTH = 16


class FederationError(RuntimeError):
    """An elastic federation cannot go on: the lighthouse is gone, too few groups, a refused join, a failing heal."""


class FederationEnded(FederationError):
    """A standby group found its federation over (every group finished or failed) as it took a place in it."""


@dataclass(frozen=True)
class Elastic:
    """Run each federation group as a job of its own, joined to the others through a lighthouse (docs/elastic.md).

    Every group job gets the same options except ``group`` (or sets ``FEDSHARD_GROUP`` in its environment). The
    strategy's ``num_groups`` is then the number of groups the federation is planned for: the training data is split
    into that many parts and group ``g`` trains on part ``g``, whichever groups are running.

    Args:
        lighthouse: The lighthouse's address, e.g. ``"http://10.0.0.1:29510"``; default: ``$TORCHFT_LIGHTHOUSE``.
        group: This group's index in ``[0, num_groups)``; default: ``$FEDSHARD_GROUP``. A group that replaces a failed
            one takes its index (and its data).
        standby: Start this job as a standby group: it loads the model and data, then waits at the lighthouse without
            training until a planned group of the running federation is gone (dead or hung), takes that group's
            index and part of the data, and joins at the federation's next sync, healing from a peer. A standby has
            no ``group`` of its own (``$FEDSHARD_GROUP`` is ignored); if the federation ends first, its ``fit``
            returns without training.
        federation: The federation's name; a job of another federation is refused by the running groups.
        min_groups: A sync runs only with at least this many groups; with fewer, the groups wait for more (up to
            ``quorum_timeout``) and then stop with an error.
        start_groups: A new federation (every group joining at once) starts training only once this many groups
            joined, so that groups whose jobs start a little later do not find the others ahead of them; default:
            ``min_groups``.
        timeout: Seconds a collective between groups, a heal's transfer or a commit vote may take: a group that hangs
            while its heartbeats go on costs the others at most this much (then it is left out).
        peer_check: Seconds between two readings of the lighthouse's status page while a collective between groups
            waits (only then): once the lighthouse counts a group of the collective as gone (no heartbeat for its
            heartbeat timeout: dead, or hung inside the sum), the others give the sync up and go on without it,
            instead of waiting ``timeout``. ``0``: never read it (wait up to ``timeout``).
        quorum_timeout: Seconds to wait for a quorum; longer than a round (a joining group waits for the others'
            next sync).
        connect_timeout: Seconds to reach the lighthouse and the managers when connecting.
        quorum_retries: Times a group retries a quorum the lighthouse did not answer (rides out a short lighthouse
            outage; a long one ends every group with an error).
        max_failures: Syncs in a row that a group may fail to commit (e.g. a heal that keeps failing) before it stops
            with an error.
        group_timeout: Seconds without a sign of life from another rank of this group before this rank ends the
            group (a group fails as a unit; a half-dead group would stall the federation at every quorum).
        hostname: The address other groups reach this group's manager at; default: the machine's host name.
        manager_port: Port of this group's manager (rank 0); default: a free one.
        secret: The federation's secret, which every group must hold; default: ``$FEDSHARD_SECRET``; ``None`` and no
            variable: no secret. With one, a group's heal server serves only requests that prove it (an HMAC), a
            joining group loads a peer's state only from a server that proves it, and a job whose proof does not
            match (no secret, another one) is refused before it trains or receives anything. It authenticates; it
            does not encrypt, and the lighthouse and gloo's collectives are not covered (docs/elastic.md, "The
            federation secret"). Never shown: not in ``repr``, logs, checkpoints or hyperparameters. At least 16
            characters, e.g. ``python -c "import secrets; print(secrets.token_hex(16))"``.
        probation: Syncs a group must have been present for before its updates count: a group that joined (a new
            group, a standby, a group that came back) adds nothing to the next ``probation`` syncs after the one it
            joined at (it trains, takes part and restarts from the federation's weights like every group). ``0``:
            a group adds from the sync after it joined. For nodes that come and go: a group must stay up
            ``probation`` syncs before it moves the federation.
    """

    #: What an elastic federation does not run yet (see :mod:`lightning_fedshard.core.rounds.options`).
    refuses: ClassVar[dict[str, Refusal]] = {}

    lighthouse: str | None = None
    group: int | None = None
    standby: bool = False
    federation: str = "fedshard"
    min_groups: int = 1
    start_groups: int | None = None
    timeout: float = 60.0
    peer_check: float = 1.0
    quorum_timeout: float = 900.0
    connect_timeout: float = 60.0
    quorum_retries: int = 10
    max_failures: int = 3
    group_timeout: float = 30.0
    hostname: str | None = None
    manager_port: int | None = None
    secret: str | None = field(default=None, repr=False)
    probation: int = 0

    def __post_init__(self) -> None:
        if self.secret is not None:
            _check_secret(self.secret, "`Elastic(secret=...)`")
        for name in ("min_groups", "max_failures"):
            check_positive_int(f"Elastic({name}=...)", getattr(self, name))
        check_positive_int(
            "Elastic(start_groups=...)", self.start_groups, allow_none=True, expected="a positive integer or None"
        )
        for name in ("quorum_retries", "probation"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"`Elastic({name}=...)` must be a non-negative integer, got {value!r}.")
        for name in ("timeout", "quorum_timeout", "connect_timeout", "group_timeout"):
            check_positive_number(f"Elastic({name}=...)", getattr(self, name), unit="seconds")
        check = self.peer_check
        if isinstance(check, bool) or not isinstance(check, (int, float)) or not 0 <= check < float("inf"):
            raise ValueError(f"`Elastic(peer_check=...)` must be a number of seconds >= 0 (0: never), got {check!r}.")
        if not self.federation or not all(c.isalnum() or c in "-." for c in self.federation):
            raise ValueError(
                f"`Elastic(federation={self.federation!r})` must be a non-empty name of letters, digits, '-' and '.'."
            )
        if self.group is not None and (not isinstance(self.group, int) or isinstance(self.group, bool)):
            raise ValueError(f"`Elastic(group=...)` must be an integer, got {self.group!r}.")
        if not isinstance(self.standby, bool):
            raise ValueError(f"`Elastic(standby=...)` must be True or False, got {self.standby!r}.")
        if self.standby and self.group is not None:
            raise ValueError(
                f"`Elastic(standby=True, group={self.group})`: a standby has no group of its own, it takes the index of"
                " the first group that is gone. Leave `group` unset (or start the job as group"
                f" {self.group} without `standby`)."
            )
        if self.start_groups is not None and self.start_groups < self.min_groups:
            raise ValueError(
                f"`Elastic(start_groups={self.start_groups})` is smaller than `min_groups={self.min_groups}`: a new"
                " federation cannot start with fewer groups than every sync needs. Set `start_groups` >= `min_groups`"
                " (or leave it None)."
            )
        if self.lighthouse is not None:
            _check_lighthouse_address(self.lighthouse, f"`Elastic(lighthouse={self.lighthouse!r})`")
        if self.manager_port is not None and (
            not isinstance(self.manager_port, int)
            or isinstance(self.manager_port, bool)
            or not 0 <= self.manager_port <= 65535
        ):
            raise ValueError(
                f"`Elastic(manager_port={self.manager_port!r})` must be a port number in [0, 65535] (0 or None: a free"
                " one)."
            )
        if self.hostname is not None and (not isinstance(self.hostname, str) or not self.hostname.strip()):
            raise ValueError(
                f"`Elastic(hostname={self.hostname!r})` must be a non-empty address the other groups reach this group"
                " at (or None: the machine's host name)."
            )

    def group_index(self, num_groups: int) -> int:
        """This group's index: ``group``, or ``$FEDSHARD_GROUP``; checked against ``num_groups``.

        Raises:
            ValueError: If neither is set, the index is outside ``[0, num_groups)``, or this job is a standby (its
                index is the one it takes at run time).
        """
        if self.standby:
            raise ValueError("A standby group has no index until it takes the place of a group that is gone.")
        group: object = self.group
        if group is None:
            value = os.environ.get(GROUP_ENV)
            if value is None:
                raise ValueError(
                    f"An elastic group needs its index: pass `Elastic(group=...)` or set ${GROUP_ENV} in the job's"
                    " environment."
                )
            try:
                group = int(value)
            except ValueError:
                raise ValueError(f"${GROUP_ENV}={value!r} is not a group index.") from None
        assert isinstance(group, int)
        source = f"`Elastic(group={group})`" if self.group is not None else f"${GROUP_ENV}={group}"
        _check_group_index(group, num_groups, source)
        return group

    def check_group(self, num_groups: int) -> None:
        """Refuse a ``group`` given in the options that is outside ``[0, num_groups)``, naming both.

        ``$FEDSHARD_GROUP`` is not read here: it belongs to the job's own environment, checked when the job starts.

        Raises:
            ValueError: If ``group`` is set and outside ``[0, num_groups)``.
        """
        if self.group is not None:
            _check_group_index(self.group, num_groups, f"`Elastic(group={self.group})`")

    def lighthouse_address(self) -> str:
        """``lighthouse``, or ``$TORCHFT_LIGHTHOUSE``.

        Raises:
            ValueError: If neither is set.
        """
        address = self.lighthouse or os.environ.get(LIGHTHOUSE_ENV)
        if not address:
            raise ValueError(
                f"An elastic group needs the lighthouse's address: pass `Elastic(lighthouse='http://host:29510')` or"
                f" set ${LIGHTHOUSE_ENV}."
            )
        source = f"`Elastic(lighthouse={address!r})`" if self.lighthouse else f"${LIGHTHOUSE_ENV}={address!r}"
        _check_lighthouse_address(address, source)
        return address

    def federation_secret(self) -> bytes | None:
        """``secret``, or ``$FEDSHARD_SECRET``, as bytes; ``None`` if neither is set.

        Raises:
            ValueError: For an empty or too short secret (its length is named, never its value).
        """
        secret = self.secret if self.secret is not None else os.environ.get(SECRET_ENV)
        if secret is None:
            return None
        source = "`Elastic(secret=...)`" if self.secret is not None else f"${SECRET_ENV}"
        _check_secret(secret, source)
        return secret.encode()

    def describe(self, group: int, num_groups: int) -> str:
        """This job's place in the federation, for the log at the start of training.

        The federation's name and its ``min_groups`` are not repeated: the sync options' line
        (``FederationConfig.describe``) that follows it names them.
        """
        standby = " (a standby that took its place)" if self.standby else ""
        lighthouse = self.lighthouse or os.environ.get(LIGHTHOUSE_ENV, "?")
        return f"elastic group {group} of {num_groups}{standby} (lighthouse {lighthouse})"


def _check_group_index(group: int, num_groups: int, source: str) -> None:
    """Refuse a group index outside ``[0, num_groups)``; ``source`` names where it came from, with its value."""
    if not 0 <= group < num_groups:
        raise ValueError(
            f"{source} is outside [0, num_groups={num_groups}): the federation is planned for {num_groups} group(s),"
            f" numbered 0 to {num_groups - 1}."
        )


def _check_secret(secret: object, source: str) -> None:
    """Refuse a secret that is not a string of at least :data:`MIN_SECRET_LENGTH` characters, without showing it."""
    if not isinstance(secret, str):
        raise ValueError(f"{source} must be a string, got a {type(secret).__name__}.")
    if len(secret) < MIN_SECRET_LENGTH:
        what = "empty" if not secret else f"{len(secret)} character(s) long"
        raise ValueError(
            f"{source} is {what}: a federation secret needs at least {MIN_SECRET_LENGTH} characters, or a stranger can"
            ' guess it. Make one with `python -c "import secrets; print(secrets.token_hex(16))"`.'
        )


def proof(secret: bytes, *parts: object) -> str:
    """The HMAC-SHA256 (hex) of ``parts`` under ``secret``: what proves the secret without showing it."""
    message = "\x1f".join(str(p) for p in parts).encode()
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def proves(secret: bytes, claimed: object, *parts: object) -> bool:
    """Whether ``claimed`` is :func:`proof` of ``parts`` under ``secret`` (compared in constant time)."""
    return isinstance(claimed, str) and hmac.compare_digest(claimed, proof(secret, *parts))


def _check_lighthouse_address(address: object, source: str) -> None:
    """Refuse a lighthouse address no group can connect to (it would fail only after ``connect_timeout``).

    Raises:
        ValueError: Naming ``source`` (where the address came from, with its value), unless it is
            ``http(s)://host[:port]``.
    """
    parsed = urlparse(address) if isinstance(address, str) else None
    try:
        valid = parsed is not None and parsed.scheme in ("http", "https") and bool(parsed.hostname)
        valid = valid and (parsed is not None and (parsed.port is None or parsed.port > 0))
    except ValueError:  # a port that is not a number, or out of range
        valid = False
    if not valid:
        raise ValueError(
            f"{source} is not a lighthouse address: it must read like 'http://10.0.0.1:29510'"
            " (`http://`, the host, the port)."
        )


__all__ = ["GROUP_ENV", "LIGHTHOUSE_ENV", "Elastic", "FederationEnded", "FederationError"]
