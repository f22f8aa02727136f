"""Adapters for Lightning Fabric: ``Fabric(strategy="fl_fsdp")`` / ``Fabric(strategy="fl_hsdp")``."""

from lightning.fabric.strategies import STRATEGY_REGISTRY

from lightning_fedshard.fabric.strategy import FLFSDPStrategy, FLHSDPStrategy

FLFSDPStrategy.register_strategies(STRATEGY_REGISTRY)
FLHSDPStrategy.register_strategies(STRATEGY_REGISTRY)

__all__ = ["FLFSDPStrategy", "FLHSDPStrategy"]
