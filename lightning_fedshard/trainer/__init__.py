"""Adapters for the Lightning ``Trainer``: the strategies and the outer-step callback."""

from lightning_fedshard.trainer.callback import OuterSync
from lightning_fedshard.trainer.strategy import FLFSDPStrategy, FLHSDPStrategy

__all__ = ["FLFSDPStrategy", "FLHSDPStrategy", "OuterSync"]
