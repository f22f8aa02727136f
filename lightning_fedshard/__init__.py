"""lightning_fedshard: federated sharded data parallelism (FL+FSDP, FL+HSDP) for PyTorch Lightning.

Importing the package registers the ``"fl_fsdp"`` and ``"fl_hsdp"`` strategies with the Lightning ``Trainer`` and
with Fabric, so ``Trainer(strategy="fl_hsdp")`` works on any LightningModule and ``Fabric(strategy="fl_fsdp")`` in
any Fabric script.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_fedshard import fabric
from lightning_fedshard.checkpoint import CheckpointTopologyWarning
from lightning_fedshard.core import FederationTopology, OuterStep, SyncStats
from lightning_fedshard.core.outer import NonFiniteOuterGradientError
from lightning_fedshard.export import export_consensus
from lightning_fedshard.trainer import FLFSDPStrategy, FLHSDPStrategy, OuterSync

FLFSDPStrategy.register_strategies(StrategyRegistry)
FLHSDPStrategy.register_strategies(StrategyRegistry)

__version__ = "0.1.0"

__all__ = [
    "fabric",
    "CheckpointTopologyWarning",
    "FLFSDPStrategy",
    "FLHSDPStrategy",
    "FederationTopology",
    "NonFiniteOuterGradientError",
    "OuterStep",
    "OuterSync",
    "SyncStats",
    "export_consensus",
]
