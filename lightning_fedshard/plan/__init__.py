"""The planner: predict throughput, traffic, memory and the bottleneck of each strategy on a cluster before a run.

:func:`predict` models one setup; :func:`compare` the four strategies; :func:`sweep` ranks the federated
configurations that fit. ``fedshard plan`` is the command line (:mod:`.command`); docs/plan.md has the equations and
the calibration against the benchmark. These modules use nothing from Lightning (only torch, through
:mod:`lightning_fedshard.core`), but importing them first runs ``lightning_fedshard/__init__.py``, which imports
Lightning to register the strategies.
"""

from lightning_fedshard.plan.predict import Collective, Memory, Prediction, predict
from lightning_fedshard.plan.specs import CLUSTERS, MODELS, STRATEGIES, ClusterSpec, ModelSpec, TrainSetup
from lightning_fedshard.plan.sweep import compare, sweep

__all__ = [
    "CLUSTERS",
    "MODELS",
    "STRATEGIES",
    "ClusterSpec",
    "Collective",
    "Memory",
    "ModelSpec",
    "Prediction",
    "TrainSetup",
    "compare",
    "predict",
    "sweep",
]
