"""What one benchmark run is: its configuration (handed to every rank) and its place in a sweep (its identity).

The sync options are the package's own record, :class:`~lightning_fedshard.core.config.FederationConfig`, with
the package's defaults: a configuration states only what it changes, and the run's JSON records every field, as the
strategy received it. The baselines are the same strategy classes with one group averaging with itself, which never
runs an outer step: exactly FSDP and HSDP.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field, replace
from typing import Any

from lightning_fedshard import Gossip, Hierarchical, Mixing, Pace, Sampled
from lightning_fedshard.core.config import FederationConfig

STRATEGIES = ("fsdp", "hsdp", "fl_fsdp", "fl_hsdp", "torchft")
#: Runs of torchft's own DiLoCo (``benchmarks/harness/torchft_train.py``): one replica group per node.
TORCHFT = "torchft"
BASELINES = ("fsdp", "hsdp")
#: The federation of a baseline: one group, plain averaging (one group averaging with itself runs no outer step).
BASELINE_FEDERATION: dict[str, Any] = {"num_groups": 1, "outer_optimizer": "fedavg"}


@dataclass(frozen=True)
class RunIdentity:
    """Where a run sits in its sweep, as the driver planned it (recorded with the run, never parsed from its name).

    Attributes:
        preset: The sweep (``"throughput"``, ``"race"``, ...).
        configuration: The configuration's name, without link or repeat (``"fl_fsdp-int8"``).
        repeat: Index of the repeat within the sweep (the race: the seed).
        link_mbit: The link rate the run trained on (Mbit/s; ``None``: unthrottled).
        seed: The run's seed (data order and initial weights).
        rtt_ms: The round trip added between two nodes (ms; runs recorded before it existed have 0).
    """

    preset: str
    configuration: str
    repeat: int
    link_mbit: float | None
    seed: int
    rtt_ms: float = 0.0

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> RunIdentity:
        """The identity from a run's JSON ``identity`` entry."""
        return cls(**record)


@dataclass(frozen=True)
class RunConfig:
    """One benchmark run, as every rank reads it (``train.py --config '<JSON>'``).

    Args:
        strategy: One of :data:`STRATEGIES`.
        num_nodes: Emulated nodes.
        devices: Ranks per node.
        out: Folder of the run's ``run.json``, logs and CSV metrics.
        cache_dir: The tokenized corpus.
        federation: The sync options (``FederationConfig``'s fields, the package's defaults unless changed); a
            baseline runs them with :data:`BASELINE_FEDERATION`.
        max_steps: Optimizer steps.
        val_every: Optimizer steps between validations.
        size: ``LlamaLM`` size.
        seq_len: Tokens per sequence.
        batch_size: Sequences per rank and step.
        vocab_size: Tokenizer vocabulary.
        lr: Inner (AdamW) learning rate; the schedule spans ``max_steps``.
        max_train_windows: Training windows used (``None``: all).
        max_val_windows: Validation windows.
        model_overrides: ``LlamaLM`` arguments replacing those of ``size``.
        seed: ``seed_everything``: the data order (the initial weights depend on ``init_seed`` only).
        init_seed: ``LlamaLM``'s ``init_seed``: the initial weights.
        cpu_quota: CPU cores each node may use (a cgroup quota per node, see ``benchmarks.harness.cpu``); ``None``:
            no limit.
        elastic_groups: FL+FSDP as an elastic federation: every node a group of its own job, the groups meeting
            through a lighthouse in the switch (with torchft's own DiLoCo's settings: a quorum and a commit vote at
            every sync), instead of one job over every node.
    """

    strategy: str
    num_nodes: int
    devices: int
    out: str
    cache_dir: str
    federation: FederationConfig = field(default_factory=FederationConfig)
    max_steps: int = 64
    val_every: int = 16
    size: str = "xs"
    seq_len: int = 128
    batch_size: int = 8
    vocab_size: int = 4096
    lr: float = 3e-3
    max_train_windows: int | None = None
    max_val_windows: int = 64
    model_overrides: dict[str, int] = field(default_factory=dict)
    seed: int = 0
    init_seed: int = 0
    cpu_quota: tuple[float, ...] | None = None
    elastic_groups: bool = False

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"`strategy` must be one of {STRATEGIES}, got {self.strategy!r}.")
        if self.elastic_groups and self.strategy != "fl_fsdp":
            raise ValueError(f"`elastic_groups` runs FL+FSDP with a group per node, not {self.strategy!r}.")
        if self.cpu_quota is not None:
            object.__setattr__(self, "cpu_quota", tuple(float(c) for c in self.cpu_quota))
            if len(self.cpu_quota) != self.num_nodes:
                raise ValueError(f"`cpu_quota={self.cpu_quota!r}` needs one quota per node ({self.num_nodes}).")

    @property
    def federated(self) -> bool:
        """FL+FSDP, FL+HSDP, or torchft's DiLoCo (whose sync options the federation record carries)."""
        return self.strategy.startswith("fl_") or self.strategy == TORCHFT

    @property
    def strategy_federation(self) -> FederationConfig:
        """The federation the strategy is built with: :attr:`federation`, or a baseline's single group."""
        return self.federation if self.federated else replace(self.federation, **BASELINE_FEDERATION)

    def strategy_kwargs(self) -> dict[str, Any]:
        """The strategy's federation keyword arguments (every field of :attr:`strategy_federation`)."""
        return federation_fields(self.strategy_federation)

    def record(self) -> dict[str, Any]:
        """The configuration as a JSON-ready dict, the federation as the strategy received it."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "federation"}
        federation = self.strategy_kwargs()
        federation["outer_topology"] = topology_record(federation["outer_topology"])
        pace = federation.get("pace")
        federation["pace"] = None if pace is None else {k: v for k, v in dataclasses.asdict(pace).items()}
        return {**fields, "federation": federation}

    def to_json(self) -> str:
        """:meth:`record` as one JSON object."""
        return json.dumps(self.record())

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> RunConfig:
        """Read :meth:`record`'s dict back; the federation is validated by ``FederationConfig``."""
        federation = dict(record.get("federation", {}))
        if "outer_topology" in federation:
            federation["outer_topology"] = topology_from_record(federation["outer_topology"])
        if federation.get("pace") is not None:
            federation["pace"] = Pace(**federation["pace"])
        return cls(**{**record, "federation": FederationConfig(**federation)})


def topology_record(topology: Any) -> Any:
    """An outer topology as JSON: a name as it is, a topology object as ``{"class": ..., "args": {...}}``."""
    if isinstance(topology, Hierarchical):
        sites = None if topology.sites is None else [list(site) for site in topology.sites]
        return {"class": "Hierarchical", "args": {"levels": topology.levels, "sites": sites}}
    if isinstance(topology, Gossip):
        return {"class": "Gossip", "args": {"peers": topology.peers, "seed": topology.seed}}
    if isinstance(topology, Sampled):
        args = {"groups_per_round": topology.groups_per_round, "seed": topology.seed}
        return {"class": "Sampled", "args": {**args, "outer_step": True} if topology.outer_step else args}
    if isinstance(topology, Mixing):
        if callable(topology.matrix):
            raise ValueError("A benchmark run's mixing must be a matrix, not a callable: the ranks read it as JSON.")
        return {"class": "Mixing", "args": {"matrix": [[float(w) for w in row] for row in topology.matrix]}}
    return topology


def topology_from_record(record: Any) -> Any:
    """Undo :func:`topology_record` (JSON turns the periods of ``levels`` into strings: they become numbers again)."""
    if not isinstance(record, dict):
        return record
    args = dict(record["args"])
    if record["class"] == "Hierarchical":
        args["levels"] = {int(period): groups for period, groups in args["levels"].items()}
    classes: dict[str, Any] = {"Hierarchical": Hierarchical, "Gossip": Gossip, "Sampled": Sampled, "Mixing": Mixing}
    return classes[record["class"]](**args)


def federation_fields(config: FederationConfig) -> dict[str, Any]:
    """Every field of ``config`` by name: the strategies' federation keyword arguments."""
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}


@dataclass(frozen=True)
class Job:
    """One run of a sweep.

    Attributes:
        name: Unique in the sweep's results: the run's folder and key.
        identity: Where it sits in the sweep.
        config: What every rank runs.
    """

    name: str
    identity: RunIdentity
    config: RunConfig
