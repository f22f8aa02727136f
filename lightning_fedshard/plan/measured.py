"""Tokens-to-target factors measured by the recipe study (written by ``python -m benchmarks.report``)."""

STUDY = "no study yet"
FACTORS: dict[tuple[object, ...], tuple[float, str, tuple[float, ...]]] = {}
