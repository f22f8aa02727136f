"""Simulate a federation's learning on one device (see :class:`Simulator` and ``fedshard simulate``)."""

from lightning_fedshard.simulate.simulator import SimulationResult, Simulator
from lightning_fedshard.simulate.strategy import SimulatedStrategy

__all__ = ["SimulatedStrategy", "SimulationResult", "Simulator"]
