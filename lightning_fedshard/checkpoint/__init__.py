"""Checkpoints of FL+FSDP / FL+HSDP runs that resume bit-identically, shared by the Trainer and Fabric strategies.

Between two syncs every federation group holds its own weights and inner optimizer state, and every rank holds its
shard of the anchor and of the outer optimizer state. Stock FSDP checkpoints lose most of that: a sharded (DCP)
checkpoint de-duplicates equal ``(key, offset)`` chunks and so mixes the groups, a full one keeps group 0 alone, and
callback state comes from rank 0 only. A checkpoint written by :class:`FederationCheckpointer` holds:

* ``state_dict`` (full) / the DCP key ``"model"`` (sharded): the **consensus**, i.e. the anchor of the last sync, in
  the plain key layout of the module, so tools that know nothing about this package can load it;
* ``"fedshard"``: ``format_version``, ``layout`` (topology and local shard sizes of the writer), ``schedule``
  (``last_synced_step``, ``num_syncs``) and **entries**, each owned by one rank:

  - ``group{g}/shard{s}``: group ``g``'s own local weight shards at in-group shard position ``s``, its inner
    optimizer states and its error-feedback residuals (written by the group's first replica; the other replicas hold
    identical copies);
  - ``outer/shard{s}``: the anchor shards and outer optimizer states (one per fragment) at position ``s``, the
    schedule and the sum of a fragment sync still in flight, completed first (identical in every group, written by
    group 0);
  - ``rng/rank{r}``: rank ``r``'s torch random number generator states.

A **full** checkpoint gathers every entry to global rank 0, which writes one file. A **sharded** checkpoint is a
directory: DCP files for the consensus, Lightning's ``meta.pt`` and ``fedshard/<entry>.pt``, one file per entry written
by its owner. Both are first written next to the target (``.<name>.partial``) and renamed into place when complete,
so an interrupted save never damages an existing checkpoint.

Nothing here depends on the Lightning ``Trainer``; it works on an FSDP-wrapped module, its optimizers and a
:class:`~lightning_fedshard.core.federation.Federation`. The modules, by concern:

* :mod:`~lightning_fedshard.checkpoint.format`: the two kinds of checkpoint, the section, entry names and layout;
* :mod:`~lightning_fedshard.checkpoint.checkpointer`: the save and load paths (:class:`FederationCheckpointer`);
* :mod:`~lightning_fedshard.checkpoint.failures`: which errors are failed collectives, and when not to save;
* :mod:`~lightning_fedshard.checkpoint.atomic`: writing files and folders so that they appear complete or not at all.
"""

from lightning_fedshard.checkpoint.checkpointer import CheckpointTopologyWarning, FederationCheckpointer
from lightning_fedshard.checkpoint.failures import (
    FederationPeerError,
    collective_failures,
    is_peer_failure,
    peer_failure_message,
    unsafe_to_save,
)
from lightning_fedshard.checkpoint.format import FEDSHARD_KEY, FORMAT_VERSION, StateDictType, layout_differences

__all__ = [
    "FEDSHARD_KEY",
    "FORMAT_VERSION",
    "CheckpointTopologyWarning",
    "FederationCheckpointer",
    "FederationPeerError",
    "StateDictType",
    "collective_failures",
    "is_peer_failure",
    "layout_differences",
    "peer_failure_message",
    "unsafe_to_save",
]
