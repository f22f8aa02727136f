"""Elastic federations: every group is a job of its own, and the groups meet through torchft.

In one job a federation's groups share one ``torch.distributed`` world: if any rank of any group fails, every group
stops. In an elastic federation each group is an ordinary job (its own launch, its own default process group, FSDP or
HSDP inside), and the sync between groups runs through `torchft <https://github.com/pytorch/torchft>`_: a *lighthouse*
decides which groups take part in each sync (the *quorum*), every rank joins a reconfigurable process group with the
ranks at its in-group position in the other groups (its fed ring), and a group that starts late or fell behind takes
the federation's state from a peer (it *heals*).

The options (:class:`~lightning_fedshard.core.options.elastic.Elastic`) and the error that ends a group
(:class:`~lightning_fedshard.core.options.elastic.FederationError`) live in the core; this package runs them:

- :mod:`~lightning_fedshard.elastic.communicator`: :class:`ElasticCommunicator`, the communicator seam on torchft's
  ``Manager`` (quorum, admission, collectives over the fed ring, commit vote);
- :mod:`~lightning_fedshard.elastic.membership`: :class:`ElasticMembership`, which joins a federation, registers its
  state for heals, and follows the groups of each sync;
- :mod:`~lightning_fedshard.elastic.quorum`: what the groups of a quorum tell each other (admission,
  :class:`MembershipChange`);
- :mod:`~lightning_fedshard.elastic.rings`, :mod:`~lightning_fedshard.elastic.heal`,
  :mod:`~lightning_fedshard.elastic.lighthouse`, :mod:`~lightning_fedshard.elastic.watchdog`: torchft's process
  groups, the heal transport, the lighthouse's status page, and the watchdog that makes a group fail as a unit.

The error-feedback residuals of int8/int4/sparse traffic are reset whenever the groups of a sync differ from the
previous sync's (their chunks are laid out over the ring).

This package knows nothing about Lightning. torchft is imported when a communicator connects, so the package imports
without it (``pip install lightning-fedshard[elastic]`` installs it).
"""

from lightning_fedshard.core.options.elastic import Elastic, FederationEnded, FederationError
from lightning_fedshard.elastic.communicator import ElasticCommunicator
from lightning_fedshard.elastic.heal import cloned
from lightning_fedshard.elastic.membership import ElasticMembership
from lightning_fedshard.elastic.quorum import MembershipChange, membership_change
from lightning_fedshard.elastic.watchdog import GroupWatchdog

#: The torchft release the elastic mode is tested with (``pip install lightning-fedshard[elastic]`` pins it).
TORCHFT_VERSION = "0.2.0"

__all__ = [
    "TORCHFT_VERSION",
    "Elastic",
    "ElasticCommunicator",
    "ElasticMembership",
    "FederationEnded",
    "FederationError",
    "GroupWatchdog",
    "MembershipChange",
    "cloned",
    "membership_change",
]
