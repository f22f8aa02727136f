"""The planner's own inputs (all but the sync options) and the model, cluster and training setup they describe."""

from __future__ import annotations

import json as jsonlib
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal

from lightning_fedshard.core.config import FederationConfig
from lightning_fedshard.core.options.checks import check_positive_int, check_positive_number
from lightning_fedshard.plan.specs import CLUSTERS, GIB, MODELS, ClusterSpec, ModelSpec, TrainSetup

#: Inputs checked here, in the units and under the names the user gives them (not the cluster fields they become).
_POSITIVE_INTS = ("seq_len", "nodes", "devices_per_node", "nodes_per_site")
_POSITIVE_NUMBERS = (
    "peak_tflops",
    "step_seconds",
    "device_memory_gib",
    "intra_gbytes_per_s",
    "inter_gbit_per_s",
    "site_mbit_per_s",
)
_AT_LEAST_ZERO = ("intra_latency_us", "inter_latency_us", "rtt_ms")


@dataclass(frozen=True)
class PlannerInputs:
    """What the planner predicts for, besides the sync options (:class:`FederationConfig`'s fields).

    Args:
        model: Model preset: the example sizes ``xs``, ``s``, ``m``, ``l`` (vocabulary 4096, 128 tokens) or
            ``llama-3.1-8b`` (2,048 tokens).
        model_config: A transformers ``config.json`` of a Llama-like model instead of the preset.
        seq_len: Tokens per sequence (default: the preset's).
        cluster: Cluster preset: ``leonardo-512`` (the paper's 128 x 4 A100) or ``emulated-4x2`` (the benchmark).
        nodes: Nodes (default: the preset's).
        devices_per_node: Ranks per node.
        peak_tflops: Peak TFLOP/s of one device at the training precision.
        mfu: Assumed model FLOPs utilization (0-1) of the compute.
        step_seconds: Measured compute seconds of one micro-batch on one rank; replaces ``peak_tflops * mfu``.
        device_memory_gib: Memory per device (GiB).
        intra_gbytes_per_s: Rank-to-rank bandwidth inside a node (GB/s).
        intra_latency_us: Latency of a message inside a node (microseconds).
        inter_gbit_per_s: Network bandwidth of one node (Gbit/s), shared by its ranks.
        inter_latency_us: Latency of a message between nodes (microseconds), one way.
        rtt_ms: Round trip between two nodes (milliseconds), e.g. 70-100 across the Atlantic: a message between
            nodes then takes half of it (instead of ``inter_latency_us``).
        nodes_per_site: Consecutive nodes that form a site (default: the preset's; ``emulated-2x2x2`` has 2).
        site_mbit_per_s: Bandwidth of each site's uplink to the other sites (Mbit/s).
        micro_batch: Sequences per rank per micro-batch.
        grad_accum: Micro-batches per optimizer step.
        precision: ``bf16`` (parameters gathered and gradients reduced in bf16, float32 master weights and AdamW) or
            ``fp32``.
        activation_checkpointing: Recompute each layer in the backward pass.
        sweep: Rank the federated configurations instead of comparing the four strategies.
        top: Rows of the sweep.
        rank: What the sweep ranks by: ``time_to_target`` (tokens/s over the tokens-to-target factor the recipe
            study measured for the row's sync options; unmeasured rows follow by tokens/s) or ``tokens_per_s``.
        node_speeds: Each node's compute speed relative to the cluster's device (e.g. ``1,1,1,0.5``): every
            federated row then also gets the tokens/s of the barrier (every group waits for the slowest at each sync)
            and of a per-group pace (``Pace``), and the attainable sum of the groups' own paces (docs/pace.md).
        json: Print JSON instead of a table.
    """

    model: str = "llama-3.1-8b"
    model_config: Path | None = None
    seq_len: int | None = None
    cluster: str = "leonardo-512"
    nodes: int | None = None
    devices_per_node: int | None = None
    peak_tflops: float | None = None
    mfu: float | None = None
    step_seconds: float | None = None
    device_memory_gib: float | None = None
    intra_gbytes_per_s: float | None = None
    intra_latency_us: float | None = None
    inter_gbit_per_s: float | None = None
    inter_latency_us: float | None = None
    rtt_ms: float | None = None
    nodes_per_site: int | None = None
    site_mbit_per_s: float | None = None
    micro_batch: int = 2
    grad_accum: int = 1
    precision: Literal["bf16", "fp32"] = "bf16"
    activation_checkpointing: bool = False
    sweep: bool = False
    top: int = 10
    rank: Literal["time_to_target", "tokens_per_s"] = "time_to_target"
    node_speeds: list[float] | None = None
    json: bool = False

    def __post_init__(self) -> None:
        check_positive_int("top", self.top)
        for name in _POSITIVE_INTS:
            check_positive_int(name, getattr(self, name), allow_none=True)
        for name in _POSITIVE_NUMBERS:
            if (value := getattr(self, name)) is not None:
                check_positive_number(name, value)
        for name in _AT_LEAST_ZERO:
            if (value := getattr(self, name)) is not None and not value >= 0:
                raise ValueError(f"`{name}={value!r}` must be at least 0.")

    def model_spec(self) -> ModelSpec:
        """The model: a transformers ``config.json`` if given, else the preset (at ``seq_len`` if given)."""
        if self.model_config is not None:
            config = SimpleNamespace(**jsonlib.loads(Path(self.model_config).read_text()))
            name = Path(self.model_config).parent.name or "model"
            return ModelSpec.from_transformers_config(config, self.seq_len or 2048, name=name)
        if self.model not in MODELS:
            raise ValueError(f"Unknown `model={self.model!r}`; choose one of {sorted(MODELS)} or give `model_config`.")
        return MODELS[self.model] if self.seq_len is None else replace(MODELS[self.model], seq_len=self.seq_len)

    def cluster_spec(self) -> ClusterSpec:
        """The cluster preset with the inputs given in place of its values (a round trip sets the nodes' latency).

        Raises:
            ValueError: For an unknown preset.
        """
        if self.cluster not in CLUSTERS:
            raise ValueError(f"Unknown `cluster={self.cluster!r}`; choose one of {sorted(CLUSTERS)}.")
        self._check_sites(CLUSTERS[self.cluster])
        changes: dict[str, Any] = {
            "num_nodes": self.nodes,
            "devices_per_node": self.devices_per_node,
            "peak_flops": _scaled(self.peak_tflops, 1e12),
            "mfu": self.mfu,
            "step_seconds": self.step_seconds,
            "device_memory": _scaled(self.device_memory_gib, GIB),
            "intra_bandwidth": _scaled(self.intra_gbytes_per_s, 1e9),
            "intra_latency": _scaled(self.intra_latency_us, 1e-6),
            "inter_bandwidth": _scaled(self.inter_gbit_per_s, 1e9 / 8),
            "inter_latency": _scaled(self._inter_latency_us(), 1e-6),
            "nodes_per_site": self.nodes_per_site,
            "site_bandwidth": _scaled(self.site_mbit_per_s, 1e6 / 8),
        }
        return replace(CLUSTERS[self.cluster], **{k: v for k, v in changes.items() if v is not None})

    def _check_sites(self, preset: ClusterSpec) -> None:
        """Refuse sites that do not cut the nodes, or that have no uplink bandwidth, naming the inputs.

        Raises:
            ValueError: Naming ``nodes_per_site`` and ``nodes`` (each marked as the preset's where not given), or
                asking for ``site_mbit_per_s``.
        """
        per_site = self.nodes_per_site or preset.nodes_per_site
        if per_site is None:
            return
        nodes = self.nodes or preset.num_nodes
        preset_note = f" (the {self.cluster} preset's)"
        if nodes % per_site:
            raise ValueError(
                f"`nodes_per_site={per_site}`{'' if self.nodes_per_site else preset_note} must divide"
                f" `nodes={nodes}`{'' if self.nodes else preset_note}: every site holds as many nodes."
            )
        if self.site_mbit_per_s is None and preset.site_bandwidth is None:
            raise ValueError(
                f"`nodes_per_site={per_site}` needs the bandwidth of each site's uplink: give `site_mbit_per_s`."
            )

    def _inter_latency_us(self) -> float | None:
        """The one-way latency between nodes: half the round trip if one is given."""
        return self.inter_latency_us if self.rtt_ms is None else self.rtt_ms * 1000 / 2

    def checked_node_speeds(self, nodes: int) -> list[float] | None:
        """``node_speeds`` as floats, after checking that they give each of the cluster's ``nodes`` a speed."""
        speeds = self.node_speeds
        if speeds is None:
            return None
        if len(speeds) != nodes or any(v <= 0 for v in speeds):
            raise ValueError(f"`node_speeds={speeds!r}` must give each of the {nodes} nodes a positive speed.")
        return [float(v) for v in speeds]

    def setup(self, federation: FederationConfig) -> TrainSetup:
        """The federated training setup these inputs and sync options describe (the sweep's base)."""
        wide = 4 if self.precision == "fp32" else 2
        return TrainSetup(
            strategy="fl_fsdp",
            federation=federation,
            micro_batch=self.micro_batch,
            grad_accum=self.grad_accum,
            param_bytes=wide,
            grad_bytes=wide,
            activation_checkpointing=self.activation_checkpointing,
        )


def _scaled(value: float | None, unit: float) -> float | None:
    return None if value is None else value * unit
