"""Adapters for the Lightning ``Trainer``: the strategies and the outer-step callback."""

from lightning_fedshard.trainer.callback import OuterSync
from lightning_fedshard.trainer.strategy import FLFSDP2Strategy, FLFSDPStrategy, FLHSDP2Strategy, FLHSDPStrategy

__all__ = ["FLFSDP2Strategy", "FLFSDPStrategy", "FLHSDP2Strategy", "FLHSDPStrategy", "OuterSync"]
