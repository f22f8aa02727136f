"""What the planner takes: a model, a cluster and a training setup, each a small frozen dataclass with presets."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal

from lightning_fedshard.core.config import FederationConfig

#: The four ways to train that the planner compares.
Strategy = Literal["fsdp", "hsdp", "fl_fsdp", "fl_hsdp"]
STRATEGIES: tuple[Strategy, ...] = ("fsdp", "hsdp", "fl_fsdp", "fl_hsdp")

GIB = 1024**3


def _positive(spec: Any, *names: str) -> None:
    """Raise ``ValueError`` naming the first of ``names`` that is not a positive number."""
    for name in names:
        value = getattr(spec, name)
        if not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"`{name}={value!r}` must be a positive number.")


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer as the planner sees it.

    Attributes:
        name: For tables.
        num_parameters: All parameters ``P``.
        root_parameters: Parameters outside the repeated layers (embeddings, output layer, final norm): FSDP's root
            unit, gathered once per micro-batch, where each layer is gathered twice (forward and backward).
        num_layers: Transformer layers ``L`` (one FSDP unit each).
        hidden_size: Width ``h``.
        num_heads: Attention heads ``a``.
        seq_len: Tokens per sequence ``T``.
    """

    name: str
    num_parameters: int
    root_parameters: int
    num_layers: int
    hidden_size: int
    num_heads: int
    seq_len: int

    @property
    def layer_parameters(self) -> int:
        """Parameters of one layer (``(P - P_root) / L``)."""
        return (self.num_parameters - self.root_parameters) // max(self.num_layers, 1)

    @property
    def flops_per_token(self) -> float:
        """Training FLOPs per token: ``6 P + 12 L h T`` (forward and backward of the weights, plus attention scores).

        The embedding lookup is counted as a matmul, which slightly overestimates small-vocabulary models.
        """
        return 6.0 * self.num_parameters + 12.0 * self.num_layers * self.hidden_size * self.seq_len

    @classmethod
    def llama(
        cls,
        name: str,
        hidden_size: int,
        num_layers: int,
        num_heads: int,
        intermediate_size: int,
        vocab_size: int,
        seq_len: int,
        num_kv_heads: int | None = None,
        tie_word_embeddings: bool = True,
    ) -> ModelSpec:
        """The sizes of a Llama (transformers' ``LlamaForCausalLM``: no biases, RMSNorm, SwiGLU MLP)."""
        kv = num_kv_heads or num_heads
        head_dim = hidden_size // num_heads
        attention = 2 * hidden_size * hidden_size + 2 * hidden_size * kv * head_dim
        layer = attention + 3 * hidden_size * intermediate_size + 2 * hidden_size
        root = vocab_size * hidden_size * (1 if tie_word_embeddings else 2) + hidden_size
        return cls(name, num_layers * layer + root, root, num_layers, hidden_size, num_heads, seq_len)

    @classmethod
    def from_transformers_config(cls, config: Any, seq_len: int, name: str | None = None) -> ModelSpec:
        """From a transformers ``LlamaConfig`` (or any config with the same field names)."""
        return cls.llama(
            name or getattr(config, "name_or_path", "") or type(config).__name__,
            hidden_size=config.hidden_size,
            num_layers=config.num_hidden_layers,
            num_heads=config.num_attention_heads,
            intermediate_size=config.intermediate_size,
            vocab_size=config.vocab_size,
            seq_len=seq_len,
            num_kv_heads=getattr(config, "num_key_value_heads", None),
            tie_word_embeddings=getattr(config, "tie_word_embeddings", True),
        )


def _example(size: str, hidden: int, layers: int, heads: int, intermediate: int) -> ModelSpec:
    # The example LlamaLM (lightning_fedshard.examples.LLAMA_SIZES) with the Shakespeare run's vocabulary and length.
    return ModelSpec.llama(f"example-{size}", hidden, layers, heads, intermediate, vocab_size=4096, seq_len=128)


#: Model presets: the example sizes and the paper's Llama-3.1-8B (sequence length 2,048, untied output layer).
MODELS: dict[str, ModelSpec] = {
    "xs": _example("xs", 128, 4, 4, 384),
    "s": _example("s", 256, 4, 4, 768),
    "m": _example("m", 384, 6, 6, 1024),
    "l": _example("l", 512, 8, 8, 1536),
    "llama-3.1-8b": ModelSpec.llama(
        "llama-3.1-8b", 4096, 32, 32, 14336, vocab_size=128256, seq_len=2048, num_kv_heads=8, tie_word_embeddings=False
    ),
}


@dataclass(frozen=True)
class ClusterSpec:
    """Nodes of identical devices joined by one network.

    Attributes:
        name: For tables.
        num_nodes: Nodes.
        devices_per_node: Ranks per node ``d``.
        peak_flops: Peak FLOP/s of one device at the training precision.
        mfu: Assumed model FLOPs utilization of the compute (used unless ``step_seconds`` is given).
        step_seconds: Measured compute seconds of one micro-batch on one rank (forward, backward and optimizer, no
            waiting for other nodes); overrides ``peak_flops * mfu``. For the emulated cluster: the no-sync pace.
        device_memory: Bytes of memory per device.
        host_memory: Bytes of host memory per node.
        intra_bandwidth: Bytes/s one rank sends to another rank of its node.
        intra_latency: Seconds per message inside a node.
        inter_bandwidth: Bytes/s one node sends into the network (shared by its ranks).
        inter_latency: Seconds per message between nodes.
        overlap_collectives: Whether in-group collectives run concurrently with compute (GPUs with FSDP prefetch:
            a step takes the longer of the two) or one after the other (CPU/gloo: the sum).
        gloo_reduce_scatter: Reduce-scatter runs as a full all-reduce (gloo), sending twice the bytes.
        tcp_mtu: MTU of the links when the collectives are gloo's over TCP: link bytes then count the framing of
            every message (gloo's headers, TCP/IP/Ethernet headers, ACKs; :mod:`lightning_fedshard.plan.framing`).
            ``None``: link bytes are the payload (e.g. NCCL over NVLink and InfiniBand).
        nodes_per_site: Consecutive nodes that form one site (``None``: one site). Traffic between sites crosses
            each site's uplink, which every flow leaving or entering the site shares.
        site_bandwidth: Bytes/s one site's uplink carries in each direction (needed with ``nodes_per_site``).
        site_latency: Seconds per message between sites.
    """

    name: str
    num_nodes: int
    devices_per_node: int
    peak_flops: float = 312e12
    mfu: float = 0.4
    step_seconds: float | None = None
    device_memory: float = 80 * GIB
    host_memory: float = 512 * GIB
    intra_bandwidth: float = 150e9
    intra_latency: float = 5e-6
    inter_bandwidth: float = 25e9
    inter_latency: float = 10e-6
    overlap_collectives: bool = True
    gloo_reduce_scatter: bool = False
    tcp_mtu: int | None = None
    nodes_per_site: int | None = None
    site_bandwidth: float | None = None
    site_latency: float = 0.0

    def __post_init__(self) -> None:
        self._check_sites()
        _positive(self, "num_nodes", "devices_per_node", "peak_flops", "device_memory", "host_memory")
        _positive(self, "intra_bandwidth", "inter_bandwidth")
        if not 0 < self.mfu <= 1:
            raise ValueError(f"`mfu={self.mfu!r}` must be in (0, 1].")
        if self.step_seconds is not None:
            _positive(self, "step_seconds")
        if self.tcp_mtu is not None:
            _positive(self, "tcp_mtu")
        if self.intra_latency < 0 or self.inter_latency < 0:
            raise ValueError(f"Latencies must be >= 0, got {self.intra_latency!r} and {self.inter_latency!r}.")

    def _check_sites(self) -> None:
        if self.nodes_per_site is None:
            return
        _positive(self, "nodes_per_site", "site_bandwidth")
        if not isinstance(self.num_nodes, int) or self.num_nodes % self.nodes_per_site:
            raise ValueError(f"`nodes_per_site={self.nodes_per_site}` must divide `num_nodes={self.num_nodes}`.")
        if self.site_latency < 0:
            raise ValueError(f"`site_latency={self.site_latency!r}` must be >= 0.")

    @property
    def world_size(self) -> int:
        """All ranks ``N``."""
        return self.num_nodes * self.devices_per_node

    def site_of(self, node: int) -> int:
        """The site of ``node`` (0 on a cluster of one site)."""
        return 0 if self.nodes_per_site is None else node // self.nodes_per_site


#: Cluster presets. ``leonardo-512`` is the paper's machine: 128 nodes x 4 A100 64 GB. Assumed: bf16 dense peak
#: 312 TFLOP/s, MFU 0.4, NVLink 3 at 100 GB/s per rank-to-rank direction, 2 x dual-port HDR100 InfiniBand per node
#: (4 x 100 Gbit/s = 50 GB/s), 5 us / 10 us latencies. ``emulated-4x2`` is the benchmark's CPU cluster (4 network
#: namespaces x 2 ranks, gloo over TCP on veth links of the default MTU 1500, throttled by tc); its compute time and
#: link rate are set per run. ``emulated-2x2x2`` is its two-site form: 2 sites of 2 nodes, 1 Gbit/s between the nodes
#: of a site and 20 Mbit/s between the sites.
_EMULATED_4X2 = ClusterSpec(
    "emulated-4x2",
    num_nodes=4,
    devices_per_node=2,
    peak_flops=50e9,
    mfu=1.0,
    device_memory=12 * GIB,
    host_memory=24 * GIB,
    intra_bandwidth=1.5e9,
    intra_latency=50e-6,
    inter_bandwidth=1.5e9,
    inter_latency=100e-6,
    overlap_collectives=False,
    gloo_reduce_scatter=True,
    tcp_mtu=1500,
)
CLUSTERS: dict[str, ClusterSpec] = {
    "leonardo-512": ClusterSpec(
        "leonardo-512",
        num_nodes=128,
        devices_per_node=4,
        peak_flops=312e12,
        mfu=0.4,
        device_memory=64 * GIB,
        host_memory=512 * GIB,
        intra_bandwidth=100e9,
        intra_latency=5e-6,
        inter_bandwidth=50e9,
        inter_latency=10e-6,
    ),
    "emulated-4x2": _EMULATED_4X2,
    "emulated-2x2x2": replace(
        _EMULATED_4X2,
        name="emulated-2x2x2",
        inter_bandwidth=1e9 / 8,
        nodes_per_site=2,
        site_bandwidth=20e6 / 8,
        site_latency=100e-6,
    ),
}


@dataclass(frozen=True)
class TrainSetup:
    """How the model is trained on the cluster.

    Attributes:
        strategy: ``"fsdp"``, ``"hsdp"``, ``"fl_fsdp"`` or ``"fl_hsdp"``.
        federation: The strategies' own options record, with their defaults: ``num_groups`` (FL only; here
            ``None`` means one group per node for FL+FSDP and 2 for FL+HSDP), ``shard_size`` (HSDP, FL+HSDP; default:
            one node) and the sync options (``sync_every``, ``fragments``, ``sync_delay``, ``reduce_dtype``,
            ``quant_block_size``, ``error_feedback``, ``outer_optimizer``; the baselines ignore them).
        micro_batch: Sequences per rank per micro-batch.
        grad_accum: Micro-batches per optimizer step.
        param_bytes: Bytes per value of gathered parameters (2 with bf16 mixed precision, 4 in float32).
        grad_bytes: Bytes per value of reduced gradients.
        master_bytes: Bytes per value of the sharded parameters and gradients kept by the optimizer.
        optimizer_bytes: Bytes of inner optimizer state per parameter (AdamW in float32: 8).
        activation_checkpointing: Recompute each layer in the backward pass (keeps only its input).
        flash_attention: Fused attention (no stored ``T x T`` scores), as transformers' SDPA default.
    """

    strategy: Strategy
    federation: FederationConfig = field(default_factory=FederationConfig)
    micro_batch: int = 1
    grad_accum: int = 1
    param_bytes: int = 4
    grad_bytes: int = 4
    master_bytes: int = 4
    optimizer_bytes: int = 8
    activation_checkpointing: bool = False
    flash_attention: bool = True

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"`strategy={self.strategy!r}` must be one of {list(STRATEGIES)}.")
        _positive(self, "micro_batch", "grad_accum", "param_bytes", "grad_bytes", "master_bytes")
        if self.optimizer_bytes < 0:
            raise ValueError(f"`optimizer_bytes={self.optimizer_bytes!r}` must be >= 0.")

    @property
    def federated(self) -> bool:
        """FL+FSDP or FL+HSDP."""
        return self.strategy.startswith("fl_")

    @property
    def hybrid(self) -> bool:
        """HSDP or FL+HSDP."""
        return self.strategy.endswith("hsdp")
