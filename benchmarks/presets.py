"""The sweeps, as data: which configurations run on which links, how often, with which model and batch.

A :class:`Configuration` names a strategy and states only what it changes from the package's defaults
(``FederationConfig``: int4 outer traffic with error feedback, ``"fedavg"``, ``sync_every=8``, ...). Most sweeps
compare the sync options against float32 outer traffic, so their federated configurations say ``float32`` where
they mean it; ``fl_fsdp-int4ef`` is the package's default sync. A :class:`Preset` is a sweep: the cluster's shape,
the settings every run shares and one repeat's list of (configuration, link) cells, run round robin (the order
reversed every other repeat) so that the machine's load drifts over every configuration alike.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.harness.config import Job, RunConfig, RunIdentity
from benchmarks.metrics import link_slug
from lightning_fedshard import Gossip, Hierarchical, Pace
from lightning_fedshard.core.config import FederationConfig

FLOAT32: dict[str, Any] = {"reduce_dtype": "float32"}
INT8: dict[str, Any] = {"reduce_dtype": "int8", "error_feedback": False}  # measured without error feedback
NOSYNC: dict[str, Any] = {"sync_every": 1024}  # longer than any run: no outer step during training
FL_HSDP: dict[str, Any] = {"num_groups": 2}  # 2 groups of 2 nodes: shard inside a node, 2 replicas per group
SPARSE: dict[str, Any] = {"reduce_dtype": "sparse"}  # SparseTopK's defaults, with error feedback
EAGER: dict[str, Any] = {"eager_updates": True}
#: torchft's DiLoCo as torchtitan drives it: float32, outer SGD at 0.7 with Nesterov momentum 0.9 (our "nesterov").
TORCHFT_SAME: dict[str, Any] = {**FLOAT32, "outer_optimizer": "nesterov"}
#: Streaming DiLoCo: 2 fragments, each sum started a step before it lands.
STREAMING: dict[str, Any] = {"fragments": 2, "sync_delay": 1}


@dataclass(frozen=True)
class Configuration:
    """A strategy and what it changes from the package's defaults.

    Attributes:
        name: Its name in every sweep (``"fl_fsdp-int8"``).
        strategy: ``"fsdp"``, ``"hsdp"``, ``"fl_fsdp"`` or ``"fl_hsdp"``.
        federation: ``FederationConfig`` fields that differ from the package's defaults.
        training: Other ``RunConfig`` fields that differ from the sweep's (e.g. a longer run).
        retired: Why it no longer runs (an option it sets was removed); its recorded runs stay, as the evidence.
    """

    name: str
    strategy: str
    federation: Mapping[str, Any] = field(default_factory=dict)
    training: Mapping[str, Any] = field(default_factory=dict)
    retired: str | None = None

    def run_config(self, training: Mapping[str, Any], **changes: Any) -> RunConfig:
        """The ``RunConfig`` of this configuration on top of a sweep's ``training`` settings.

        Raises:
            ValueError: For a retired configuration, saying why.
        """
        if self.retired is not None:
            raise ValueError(f"The configuration {self.name!r} no longer runs: {self.retired}")
        settings = {**training, **self.training, **changes}
        return RunConfig(strategy=self.strategy, federation=FederationConfig(**self.federation), **settings)


def _catalogue(*configurations: Configuration) -> dict[str, Configuration]:
    return {c.name: c for c in configurations}


#: Every configuration a sweep or the race runs, by name.
CONFIGURATIONS = _catalogue(
    Configuration("fsdp", "fsdp"),
    Configuration("hsdp", "hsdp"),
    Configuration("fl_fsdp", "fl_fsdp", FLOAT32),
    Configuration("fl_hsdp", "fl_hsdp", {**FLOAT32, **FL_HSDP}),
    Configuration("fl_fsdp-nosync", "fl_fsdp", {**FLOAT32, **NOSYNC}),
    Configuration("fl_hsdp-nosync", "fl_hsdp", {**FLOAT32, **FL_HSDP, **NOSYNC}),
    Configuration("fl_fsdp-int4ef", "fl_fsdp"),  # the package's default sync
    Configuration("fl_hsdp-int4ef", "fl_hsdp", FL_HSDP),
    Configuration("fl_fsdp-int4ef-d1", "fl_fsdp", {"sync_delay": 1}),
    Configuration("fl_fsdp-int4ef-f4-d1", "fl_fsdp", {"fragments": 4, "sync_delay": 1}),
    Configuration("fl_fsdp-int8", "fl_fsdp", INT8),
    Configuration("fl_fsdp-int8-d4", "fl_fsdp", {**INT8, "sync_delay": 4}),
    Configuration("fl_fsdp-bf16", "fl_fsdp", {"reduce_dtype": "bfloat16"}),
    Configuration("fl_fsdp-f4-d1", "fl_fsdp", {**FLOAT32, "fragments": 4, "sync_delay": 1}),
    Configuration("fl_fsdp-d2", "fl_fsdp", {**FLOAT32, "sync_delay": 2}),
    # One whole round, like sync_every=8's 16 steps.
    Configuration("fl_fsdp-H32", "fl_fsdp", {**FLOAT32, "sync_every": 32}, {"max_steps": 32, "val_every": 32}),
    Configuration("fl_fsdp-nesterov", "fl_fsdp", {**FLOAT32, "outer_optimizer": "nesterov"}),
    Configuration("fl_fsdp-sparse", "fl_fsdp", SPARSE),
    Configuration("fl_fsdp-sparse-eager", "fl_fsdp", {**SPARSE, **EAGER}),
    Configuration(
        "fl_fsdp-sparse-weights",
        "fl_fsdp",
        {**SPARSE, "error_feedback": "weights"},
        retired="`error_feedback='weights'` was removed (these runs are why)",
    ),
    Configuration("fl_fsdp-int4ef-eager", "fl_fsdp", EAGER),
    Configuration("fl_fsdp-sparse-eager-local", "fl_fsdp", {**SPARSE, "eager_updates": "local"}),
    Configuration("fl_fsdp-int4ef-eager-local", "fl_fsdp", {"eager_updates": "local"}),
    # Outer topologies on the two-site cluster: 4 one-node groups, sites {0, 1} and {2, 3}, float32 everywhere.
    Configuration("fl_fsdp-H4", "fl_fsdp", {**FLOAT32, "sync_every": 4}),
    Configuration("fl_fsdp-H16", "fl_fsdp", {**FLOAT32, "sync_every": 16}),
    Configuration(
        "fl_fsdp-sites-4-16", "fl_fsdp", {**FLOAT32, "sync_every": 4, "outer_topology": Hierarchical({4: 2, 16: 4})}
    ),
    Configuration("fl_fsdp-gossip-H4", "fl_fsdp", {**FLOAT32, "sync_every": 4, "outer_topology": Gossip(peers=1)}),
    # Against torchft's own DiLoCo (one rank per node): its settings (torchtitan's outer Nesterov, float32 traffic)
    # on both systems, streaming with 2 fragments and a one-step delay, and this package's defaults.
    Configuration("torchft-diloco", "torchft", TORCHFT_SAME),
    Configuration("fl_fsdp-torchft-same", "fl_fsdp", TORCHFT_SAME),
    Configuration("torchft-streaming", "torchft", {**TORCHFT_SAME, **STREAMING}),
    Configuration("fl_fsdp-torchft-streaming", "fl_fsdp", {**TORCHFT_SAME, **STREAMING}),
    Configuration("fl_fsdp-defaults", "fl_fsdp"),
    Configuration("fl_fsdp-defaults-elastic", "fl_fsdp", {}, {"elastic_groups": True}),
    Configuration("fl_fsdp-torchft-same-elastic", "fl_fsdp", TORCHFT_SAME, {"elastic_groups": True}),
)

#: (configuration, link rate in Mbit/s or ``None``), or with a round trip added between nodes (ms) as a third item.
Cell = tuple[Configuration, float | None] | tuple[Configuration, float | None, float]


@dataclass(frozen=True)
class Preset:
    """A sweep.

    Attributes:
        name: The ``--preset`` name; its results go to ``benchmarks/results/<name>.json``.
        summary: One line for ``--help`` and the docs.
        minutes: About how long it takes on 2 CPU cores.
        num_nodes: Emulated nodes.
        devices: Ranks per node.
        training: ``RunConfig`` fields every run shares.
        cells: One repeat: (configuration, link rate in Mbit/s or ``None`` for unthrottled[, round trip in ms]), in
            order.
        repeats: Repeats of the cells.
        timeout: Seconds one run may take.
        sites: Sites of the emulated cluster (consecutive nodes; 1: every node behind one switch).
        between_sites_mbit: The rate of every uplink between sites (Mbit/s; ``None``: unthrottled).
        seed_per_repeat: Repeat ``r`` trains with seed ``r`` (data order and initial weights), so that the repeats
            also give the perplexity's spread over seeds; otherwise every repeat uses the training's seed.
        latency: The cluster's switch is the user-space relay that adds the cells' round trips
            (:mod:`benchmarks.harness.relay`); every cell of such a preset runs through it, at 0 ms too.
    """

    name: str
    summary: str
    minutes: float
    num_nodes: int
    devices: int
    training: Mapping[str, Any]
    cells: tuple[Cell, ...]
    repeats: int = 1
    timeout: float = 900.0
    sites: int = 1
    between_sites_mbit: float | None = None
    seed_per_repeat: bool = False
    latency: bool = False

    def jobs(self, work: Path, repeats: int | None = None) -> list[Job]:
        """Every run, round robin over the cells, the order reversed every other repeat."""
        return [self.job(work, cell, repeat) for repeat, cell in self._schedule(repeats or self.repeats)]

    def job(self, work: Path, cell: Cell, repeat: int) -> Job:
        """The run of ``cell`` in repeat ``repeat``, its files under ``work``."""
        configuration, link, *rest = cell
        rtt = float(rest[0]) if rest else 0.0
        name = f"{configuration.name}-{link_slug(link)}{f'-rtt{rtt:g}ms' if self.latency else ''}-r{repeat}"
        seeds = {"seed": repeat, "init_seed": repeat} if self.seed_per_repeat else {}
        config = configuration.run_config(self.shape(work), out=str(work / name), **seeds)
        return Job(name, RunIdentity(self.name, configuration.name, repeat, link, config.seed, rtt), config)

    def shape(self, work: Path) -> dict[str, Any]:
        """The settings every run shares, with the cluster's shape and the data cache under ``work``."""
        return {"num_nodes": self.num_nodes, "devices": self.devices, "cache_dir": str(work / "data"), **self.training}

    def _schedule(self, repeats: int) -> Iterator[tuple[int, Cell]]:
        for repeat in range(repeats):
            for cell in self.cells if repeat % 2 == 0 else self.cells[::-1]:
                yield repeat, cell


#: The model, batch and length of every sweep on the 4 x 2 cluster: 16 steps, the pace window is steps 9-16, one
#: whole round after the first sync (see :func:`benchmarks.metrics.pace_window`).
TRAINING_4X2: dict[str, Any] = {
    "max_steps": 16,
    "val_every": 16,
    "size": "xs",
    "seq_len": 128,
    "batch_size": 4,
    "max_val_windows": 8,
}
#: The eager sweep: 32 steps, so its pace window (steps 9-32) holds three landings of a sum that travelled a round.
TRAINING_EAGER: dict[str, Any] = {**TRAINING_4X2, "max_steps": 32, "val_every": 32}
#: Sync options of the eager sweep, on each of its slow links.
EAGER_OPTIONS = ("fl_fsdp-int4ef", "fl_fsdp-sparse", "fl_fsdp-sparse-eager", "fl_fsdp-int4ef-eager")
#: The sites sweep: 32 steps, so that flat ``sync_every=16`` and the hierarchical federation meet twice.
TRAINING_SITES: dict[str, Any] = {**TRAINING_4X2, "max_steps": 32, "val_every": 32}
#: Its outer topologies, all float32 and plain averaging.
SITES_OPTIONS = ("fl_fsdp-H4", "fl_fsdp-H16", "fl_fsdp-sites-4-16", "fl_fsdp-gossip-H4")
#: Its links: 1 Gbit/s between the nodes of a site, 20 Mbit/s between the two sites.
SITES_NODE_MBIT, SITES_BETWEEN_MBIT = 1000.0, 20.0
#: Link rates of the throughput sweep (Mbit/s; None: unthrottled).
THROUGHPUT_LINKS: tuple[float | None, ...] = (None, 200.0, 50.0, 20.0)
#: Sync options measured beside float32 on the slow links of the throughput sweep.
THROUGHPUT_OPTIONS = ("fl_fsdp-int8", "fl_fsdp-int4ef-f4-d1")
SYNC_GRID_OPTIONS = (
    "fl_fsdp",
    "fl_fsdp-bf16",
    "fl_fsdp-int8",
    "fl_fsdp-int4ef",
    "fl_fsdp-f4-d1",
    "fl_fsdp-d2",
    "fl_fsdp-int8-d4",
    "fl_fsdp-H32",
)


def _cells(*names: str, link: float | None) -> list[Cell]:
    return [(CONFIGURATIONS[name], link) for name in names]


def _throughput_cells(link: float | None) -> list[Cell]:
    """One link's cells of the throughput sweep."""
    cells = _cells("fsdp", "hsdp", "fl_fsdp", "fl_hsdp", "fl_hsdp-nosync", link=link)
    if link is None:  # FL+FSDP's groups are whole nodes, which send nothing across links between syncs
        cells += _cells("fl_fsdp-nosync", link=None)
    if link is not None and link <= 50:
        cells += _cells(*THROUGHPUT_OPTIONS, link=link)
    return cells


SMOKE = Configuration(
    "smoke",
    "fl_fsdp",
    {"sync_every": 2},
    {
        "max_steps": 4,
        "val_every": 4,
        "seq_len": 32,
        "batch_size": 2,
        "vocab_size": 256,
        "max_train_windows": 64,
        "max_val_windows": 4,
        "model_overrides": {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "intermediate_size": 64},
    },
)


#: The side by side with torchft: 4 nodes of one rank (torchft's DiLoCo wraps plain modules), 64 steps of 8 x 128
#: tokens per rank, a sync every 8 (the package's default), validation at the end.
TORCHFT_TRAINING: dict[str, Any] = {
    "max_steps": 64, "val_every": 64, "size": "xs", "seq_len": 128, "batch_size": 8, "max_val_windows": 32,
}  # fmt: skip
TORCHFT_OPTIONS = (
    "torchft-diloco", "fl_fsdp-torchft-same", "fl_fsdp-defaults", "torchft-streaming", "fl_fsdp-torchft-streaming",
    "fl_fsdp-torchft-same-elastic", "fl_fsdp-defaults-elastic",
)  # fmt: skip
TORCHFT_LINKS: tuple[float | None, ...] = (None, 50.0, 20.0, 5.0)
TORCHFT_SMOKE = Configuration(
    "torchft-smoke",
    "torchft",
    {**TORCHFT_SAME, "sync_every": 2},
    {k: v for k, v in SMOKE.training.items()},
)

#: Groups of different speeds: 4 nodes of one rank (4 groups), every node under a CPU quota so that the last one
#: trains at half the others' pace and its idle share goes to nobody. 96 steps of 8 x 128 tokens per rank (12
#: rounds of the default 8 steps); the no-sync run gives each group's own pace, whose sum is the attainable pace (it
#: runs a pace of equal speeds, which trains every step, so that no per-step collective of the Trainer couples the
#: groups: see docs/pace.md).
FAST_CORES = 0.45
HETERO_QUOTA = (FAST_CORES, FAST_CORES, FAST_CORES, FAST_CORES / 2)
HETERO_TRAINING: dict[str, Any] = {
    "max_steps": 96, "val_every": 96, "size": "xs", "seq_len": 128, "batch_size": 8, "max_val_windows": 32,
}  # fmt: skip
HETERO = (
    Configuration("hetero-nosync", "fl_fsdp", {**NOSYNC, "pace": Pace(speeds=(1.0,) * 4)}, {"cpu_quota": HETERO_QUOTA}),
    Configuration("hetero-barrier", "fl_fsdp", {}, {"cpu_quota": HETERO_QUOTA}),
    Configuration("hetero-pace", "fl_fsdp", {"pace": Pace()}, {"cpu_quota": HETERO_QUOTA}),
    Configuration("hetero-allfast", "fl_fsdp", {}, {"cpu_quota": (FAST_CORES,) * 4}),
    Configuration(
        "hetero-allfast-nosync",
        "fl_fsdp",
        {**NOSYNC, "pace": Pace(speeds=(1.0,) * 4)},
        {"cpu_quota": (FAST_CORES,) * 4},
    ),
)

#: Latency between nodes: the 4 x 2 cluster at 20 Mbit/s through the relay, every configuration at a round trip of 0
#: and of 100 ms (across the Atlantic, or between US coasts).
LATENCY_MBIT = 20.0
LATENCY_RTTS_MS = (0.0, 100.0)
#: The no-sync pace over 88 steps (a window of about 25 s): over the 8-step window of the 16-step runs (2-3 s) it
#: spread from 6,759 to 15,514 tokens/s at one round trip, far more than the 2% the target resolves.
LATENCY_NOSYNC = Configuration(
    "fl_fsdp-nosync-long", "fl_fsdp", {**FLOAT32, **NOSYNC}, {"max_steps": 96, "val_every": 96}
)
LATENCY = (
    CONFIGURATIONS["fl_fsdp-nosync"],
    LATENCY_NOSYNC,
    *(CONFIGURATIONS[name] for name in ("fl_fsdp-int4ef", "fl_hsdp-int4ef", "fsdp")),
)

#: Wall time to a target: the recipe study's model and batch per step (4 groups of one rank, 4 windows of 128 tokens
#: each: 16 windows a step) on 4 nodes of one rank, so that the study's tokens to target and these tokens/s join. FSDP's
#: steps are regular and slow on the slow links: 12 steps (its pace over steps 9-12).
WALLTIME_TRAINING: dict[str, Any] = {
    "max_steps": 32, "val_every": 32, "size": "xs", "seq_len": 128, "batch_size": 4, "max_val_windows": 8,
}  # fmt: skip
WALLTIME_LINKS: tuple[float | None, ...] = (None, 50.0, 20.0, 5.0)
WALLTIME = (
    Configuration("walltime-fsdp", "fsdp", {}, {"max_steps": 12, "val_every": 12}),
    Configuration("walltime-fedavg-f32", "fl_fsdp", FLOAT32),
    Configuration("walltime-defaults", "fl_fsdp"),
)

PRESETS: dict[str, Preset] = {
    preset.name: preset
    for preset in (
        Preset(
            "throughput",
            "FSDP, HSDP, FL+FSDP and FL+HSDP on every link, with their no-sync pace and two sync options",
            60,
            4,
            2,
            TRAINING_4X2,
            tuple(cell for link in THROUGHPUT_LINKS for cell in _throughput_cells(link)),
            repeats=3,
        ),
        Preset(
            "sync_grid",
            "FL+FSDP's sync options one at a time at 50 Mbit/s, with the unthrottled no-sync pace",
            18,
            4,
            2,
            TRAINING_4X2,
            (*_cells("fl_fsdp-nosync", link=None), *_cells(*SYNC_GRID_OPTIONS, link=50.0)),
            repeats=3,
        ),
        Preset(
            "defaults",
            "the package's default sync and float32 against FSDP at 20 Mbit/s",
            12,
            4,
            2,
            TRAINING_4X2,
            tuple(_cells("fsdp", "fl_fsdp", "fl_fsdp-int4ef", link=20.0)),
            repeats=3,
        ),
        Preset(
            "eager",
            "sparse traffic and eager updates against the int4 default at 5 and 20 Mbit/s, with float32's bytes",
            25,
            4,
            2,
            TRAINING_EAGER,
            (
                *_cells("fl_fsdp-nosync", link=None),
                *_cells(*EAGER_OPTIONS, link=5.0),
                *_cells("fl_fsdp", *EAGER_OPTIONS, link=20.0),
            ),
            repeats=3,
        ),
        Preset(
            "sites",
            "outer topologies on 2 sites x 2 nodes x 2 ranks: 1 Gbit/s inside a site, 20 Mbit/s between the sites",
            16,
            4,
            2,
            TRAINING_SITES,
            (*_cells("fl_fsdp-nosync", link=None), *_cells(*SITES_OPTIONS, link=SITES_NODE_MBIT)),
            repeats=3,
            sites=2,
            between_sites_mbit=SITES_BETWEEN_MBIT,
            seed_per_repeat=True,
        ),
        Preset(
            "quick",
            "a check of a change: FSDP and FL+FSDP with the default sync at 50 Mbit/s, once",
            3,
            4,
            2,
            TRAINING_4X2,
            tuple(_cells("fsdp", "fl_fsdp-int4ef", link=50.0)),
        ),
        Preset(
            "torchft",
            "torchft's own DiLoCo against this package, same model, data and links, 4 nodes x 1 rank",
            90,
            4,
            1,
            TORCHFT_TRAINING,
            tuple(cell for link in TORCHFT_LINKS for cell in _cells(*TORCHFT_OPTIONS, link=link)),
            repeats=3,
            timeout=600.0,
            seed_per_repeat=True,
        ),
        Preset(
            "smoke",
            "2 nodes x 1 rank, a tiny model, 4 FL+FSDP steps on a 20 Mbit/s link: keeps the harness working",
            0.5,
            2,
            1,
            {},
            ((SMOKE, 20.0),),
            timeout=120.0,
        ),
        Preset(
            "walltime",
            "the recipe study's batch on 4 nodes of one rank: FSDP, float32 averaging and the defaults on every link",
            45,
            4,
            1,
            WALLTIME_TRAINING,
            tuple((c, link) for link in WALLTIME_LINKS for c in WALLTIME),
            repeats=3,
        ),
        Preset(
            "latency",
            "a 100 ms round trip between nodes against none, at 20 Mbit/s: no-sync pace, a sync, FL+HSDP and FSDP",
            40,
            4,
            2,
            TRAINING_4X2,
            tuple((configuration, LATENCY_MBIT, rtt) for configuration in LATENCY for rtt in LATENCY_RTTS_MS),
            repeats=3,
            latency=True,
        ),
        Preset(
            "hetero",
            "4 groups, one at half the others' CPU: the barrier, a per-group pace, all fast, and their no-sync paces",
            16,
            4,
            1,
            HETERO_TRAINING,
            tuple((c, None) for c in HETERO),
            repeats=3,
            timeout=600.0,
        ),
    )
}

# -- the race to perplexity ------------------------------------------------------------------------------------------

#: Step budgets per curve. HSDP shares FSDP's curve (see ``benchmarks.race``). The federated runs end on a sync step,
#: so their final model is the consensus.
RACE_BUDGETS: dict[str, tuple[int, ...]] = {
    "fsdp": (8, 16, 24, 32, 48, 64),
    "fl_fsdp": (8, 16, 32, 64),
    "fl_hsdp": (8, 16, 32, 64),
}
#: The learning rates tried at every budget (seed 0), by budget: the two shortest budgets preferred the largest
#: rate everywhere, with 1.5e-3 far behind, so the longer budgets start one step higher.
RACE_LEARNING_RATES: dict[int, tuple[float, ...]] = {8: (1.5e-3, 3e-3, 6e-3), 16: (1.5e-3, 3e-3, 6e-3)}
RACE_LONGER_BUDGET_RATES: tuple[float, ...] = (3e-3, 6e-3, 1.2e-2)
RACE_MAX_EXTENSIONS = 1
RACE_SEEDS: tuple[int, ...] = (0, 1, 2)
#: FL+FSDP's sync options compared at its largest budget and learning rate.
RACE_OPTIONS = (
    "fl_fsdp-bf16",
    "fl_fsdp-int8",
    "fl_fsdp-int4ef-f4-d1",
    "fl_fsdp-nesterov",
    "fl_fsdp-int4ef",
    "fl_fsdp-int4ef-d1",
    "fl_fsdp-sparse",
    "fl_fsdp-sparse-eager",
    "fl_fsdp-sparse-eager-local",
    "fl_fsdp-int4ef-eager-local",
)
#: Every race run trains on the unthrottled 4 x 2 cluster with the sweeps' model and batch, scored on a larger
#: validation set.
RACE_TRAINING: dict[str, Any] = {**TRAINING_4X2, "max_val_windows": 128}
RACE = Preset("race", "the race to perplexity", 75, 4, 2, RACE_TRAINING, (), timeout=900.0)


def race_job(work: Path, configuration: str, steps: int, lr: float, seed: int) -> Job:
    """One race run: ``configuration`` with a schedule sized to ``steps``, learning rate ``lr`` and ``seed``."""
    name = f"{configuration}-s{steps}-lr{lr:g}-seed{seed}"
    changes = {"max_steps": steps, "val_every": steps, "lr": lr, "seed": seed, "init_seed": seed}
    config = CONFIGURATIONS[configuration].run_config(RACE.shape(work), out=str(work / name), **changes)
    return Job(name, RunIdentity(RACE.name, configuration, seed, None, seed), config)
