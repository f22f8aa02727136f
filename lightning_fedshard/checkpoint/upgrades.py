"""Every older checkpoint format this version reads, upgraded in one place before anything loads it.

Each upgrade names the format it reads by the version of lightning_fedshard (0.1.0, unreleased, by the change that
ended the format) that wrote it, and turns it into the current one; the code that loads a checkpoint then knows only
the current format. ``tests/checkpoint/test_upgrades.py`` loads a file of each format that a run could have written.

==========================================================  =========================================================
format (written by lightning_fedshard 0.1.0 ...)             upgrade
==========================================================  =========================================================
before streaming fragments (a5ff39f, 2026-11-30)            ``last_step`` = the last sync, one fragment that landed then
before syncs recorded their participants (57e56ed)          a sum in flight of every group of the job
before site syncs were counted (d929bc3, 2026-12-03)        no site sync so far
before sampled rounds (761c98c, 2026-12-03)                 a sum in flight with no joined and no idle group
before a pending sum named its kind (this release)          an outer step (a mix's, in a mixing round's group state)
before participation rules kept their state by name         the pace's schedule moves into its rule; a probation's
(this release)                                              state is named
before Fabric kept the user's keys (this release)           the consensus under ``"state_dict"`` (:func:`model_key`)
before layouts named their fragments                        one fragment
==========================================================  =========================================================
"""

from __future__ import annotations

from typing import Any

from lightning_fedshard.checkpoint.format import FABRIC_KEY, TRAINER_MODEL_KEY, ModelKey, fabric_model_key

#: Layout entries that older checkpoints lack, with the value they implied (before layouts named their fragments).
LAYOUT_DEFAULTS: dict[str, Any] = {"fragments": 1}
#: The kind of a pending sum that does not name one: a round's sum in flight was an outer step's.
_OUTER_STEP = "outer step"


def federation_state(state: dict[str, Any], fragments: int, groups: int) -> dict[str, Any]:
    """A federation's saved state (its ``outer`` entry) in the current format, whatever version wrote it.

    Args:
        state: The saved state, as ``Federation.state_dict`` of some version wrote it.
        fragments: The run's streaming fragments (a state from before fragments had one).
        groups: The job's groups (a sum in flight from before participants were recorded had every one).
    """
    state = dict(state)
    last = int(state["last_synced_step"])
    state.setdefault("last_step", last)  # before fragments: the last handled step was the last sync
    state.setdefault("landed_at", [last] * fragments)
    if state.get("outer") is not None:
        state["outer"] = {"site_syncs": 0, **state["outer"]}
    if state.get("pending") is not None:
        state["pending"] = pending_sum(state["pending"], groups)
    state["eager"] = {f: pending_sum(s, groups) for f, s in (state.get("eager") or {}).items()}
    if "pace" in state:
        state["participation"] = participation_state(state.pop("pace"), state.get("participation"))
    return state


def group_state(state: dict[str, Any], groups: int) -> dict[str, Any]:
    """A federation's saved group state (residuals, offsets, a mix in flight) in the current format."""
    state = dict(state)
    if state.get("mix") is not None:
        state["mix"] = pending_sum(state["mix"], groups, kind="mix")
    return state


def pending_sum(state: dict[str, Any], groups: int, kind: str = _OUTER_STEP) -> dict[str, Any]:
    """A saved sum in flight in the current format: it names its kind, participants, joined and idle groups."""
    return {
        "kind": kind,
        "participants": list(range(groups)),
        "joined": [],
        "idle": [],
        **{k: v for k, v in state.items() if not (k == "participants" and not v)},
    }


def participation_state(pace: dict[str, Any] | None, participation: dict[str, Any] | None) -> dict[str, Any]:
    """The participation rules' state by name, from the layout before rules kept their state by name.

    That layout kept the pace's schedule under the federation's own ``"pace"`` key and the rules' states by position
    (the pace first, then a probation), or a single rule's state as it was: only a probation kept any (``"seen"``).
    """
    rules: dict[str, Any] = {}
    if pace is not None:
        rules["pace"] = {"schedule": pace}
    old = participation or {}
    probation = old.get("1") if "1" in old else old if "seen" in old else None
    if probation is not None:
        rules["probation"] = probation
    return rules


def model_key(metadata: dict[str, Any]) -> ModelKey:
    """Where a checkpoint holds the consensus, from its metadata (a full file's dict, or a sharded one's ``meta.pt``).

    A Fabric checkpoint names the user's key of the model under ``"fedshard_fabric"``. The Trainer's checkpoints,
    plain Lightning ones, and Fabric checkpoints written before Fabric kept the user's keys (they stored the model as
    the Trainer does) use the Trainer's layout.
    """
    key = (metadata.get(FABRIC_KEY) or {}).get("model_key")
    return TRAINER_MODEL_KEY if key is None else fabric_model_key(key)


def layout(saved: dict[str, Any]) -> dict[str, Any]:
    """A saved layout (topology, shard sizes) with what older ones lacked (:data:`LAYOUT_DEFAULTS`)."""
    return {**LAYOUT_DEFAULTS, **saved}


__all__ = [
    "LAYOUT_DEFAULTS",
    "federation_state",
    "group_state",
    "layout",
    "model_key",
    "participation_state",
    "pending_sum",
]
