"""Adapters for Lightning Fabric: ``"fl_fsdp"`` / ``"fl_hsdp"`` and, on FSDP2, ``"fl_fsdp2"`` / ``"fl_hsdp2"``."""

from lightning.fabric.strategies import STRATEGY_REGISTRY

from lightning_fedshard.fabric.strategy import FLFSDP2Strategy, FLFSDPStrategy, FLHSDP2Strategy, FLHSDPStrategy

FLFSDPStrategy.register_strategies(STRATEGY_REGISTRY)
FLHSDPStrategy.register_strategies(STRATEGY_REGISTRY)
FLFSDP2Strategy.register_strategies(STRATEGY_REGISTRY)
FLHSDP2Strategy.register_strategies(STRATEGY_REGISTRY)

__all__ = ["FLFSDP2Strategy", "FLFSDPStrategy", "FLHSDP2Strategy", "FLHSDPStrategy"]
