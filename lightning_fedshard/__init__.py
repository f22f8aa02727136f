"""lightning_fedshard: federated sharded data parallelism (FL+FSDP, FL+HSDP) for PyTorch Lightning.

Importing the package registers the ``"fl_fsdp"`` and ``"fl_hsdp"`` strategies (FSDP1) and ``"fl_fsdp2"`` and
``"fl_hsdp2"`` (FSDP2, ``fully_shard``) with the Lightning ``Trainer`` and with Fabric, so
``Trainer(strategy="fl_hsdp")`` works on any LightningModule and ``Fabric(strategy="fl_fsdp")`` in any Fabric script.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_fedshard import fabric
from lightning_fedshard.checkpoint import CheckpointTopologyWarning
from lightning_fedshard.core import (
    BlockQuantizer,
    Elastic,
    FederationConfig,
    FederationEnded,
    FederationError,
    FederationTopology,
    FloatCodec,
    Gossip,
    Hierarchical,
    Mixing,
    OuterStep,
    Pace,
    Sampled,
    SparseLoCo,
    SparseTopK,
    SyncStats,
)
from lightning_fedshard.core.step.nonfinite import NonFiniteOuterGradientError
from lightning_fedshard.export import export_consensus
from lightning_fedshard.trainer import FLFSDP2Strategy, FLFSDPStrategy, FLHSDP2Strategy, FLHSDPStrategy, OuterSync

FLFSDPStrategy.register_strategies(StrategyRegistry)
FLHSDPStrategy.register_strategies(StrategyRegistry)
FLFSDP2Strategy.register_strategies(StrategyRegistry)
FLHSDP2Strategy.register_strategies(StrategyRegistry)

__version__ = "0.1.0"

__all__ = [
    "fabric",
    "BlockQuantizer",
    "CheckpointTopologyWarning",
    "Elastic",
    "FLFSDP2Strategy",
    "FLFSDPStrategy",
    "FLHSDP2Strategy",
    "FLHSDPStrategy",
    "FederationConfig",
    "FederationEnded",
    "FederationError",
    "FederationTopology",
    "FloatCodec",
    "Gossip",
    "Hierarchical",
    "Mixing",
    "NonFiniteOuterGradientError",
    "OuterStep",
    "OuterSync",
    "Pace",
    "Sampled",
    "SparseLoCo",
    "SparseTopK",
    "SyncStats",
    "export_consensus",
]
