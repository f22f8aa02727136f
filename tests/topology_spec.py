"""Outer topologies written in a JSON scenario spec, built alike by the workers and the tests' references."""

from __future__ import annotations

from typing import Any

from lightning_fedshard import Gossip, Hierarchical, Mixing, Sampled


def outer_topology(spec: dict[str, Any]) -> Hierarchical | Mixing:
    """``{"levels": {period: groups}, "sites": [[...], ...]}``, ``{"gossip": {...}}``, ``{"sampled": {...}}`` or
    ``{"matrix": [[...], ...]}``; JSON keys are strings, so the periods are turned back into numbers."""
    if "levels" in spec:
        levels = {int(period): groups for period, groups in spec["levels"].items()}
        return Hierarchical(levels, sites=spec.get("sites"))
    if "gossip" in spec:
        return Gossip(**spec["gossip"])
    if "sampled" in spec:
        return Sampled(**spec["sampled"])
    return Mixing(spec["matrix"])
