"""The analytic model: time, traffic and memory of one training setup on one cluster (docs/plan.md has the equations).

Every collective is a ring over a known list of global ranks (rank ``r`` lives on node ``r // d``). A ring of ``n``
ranks moving a tensor of ``V`` bytes sends ``(n-1)/n V`` per rank and per ring edge for an all-gather or a
reduce-scatter, twice that for an all-reduce, in ``n - 1`` (all-reduce: ``2 (n - 1)``) latency-bound steps. Edges
between ranks of one node use the rank's intra-node bandwidth; edges that leave a node share the node's network
bandwidth with every other ring of the same collective running at the same time (all replicas, all in-group
positions). A collective takes the longer of its slowest node's network time and its slowest rank's intra-node time,
plus its latency. The outer sum uses the core's own byte count (:meth:`wire_bytes` of the reducer the strategy
builds), so compressed traffic is counted exactly as it is sent; each sync also sums two small statistics vectors (the
NaN/Inf flags and the norms) over the fed ring and inside the group.

Link bytes are the payload, plus, on a cluster whose ``tcp_mtu`` is set (gloo over TCP, as the emulated cluster), the
framing of every message that leaves a node: gloo's headers, TCP/IP/Ethernet headers and ACKs
(:func:`~lightning_fedshard.plan.framing.framed_bytes`), from the message counts of gloo's algorithms. Times use the
payload.
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace

from lightning_fedshard.core.config import FederationConfig
from lightning_fedshard.core.options.outer_topology import Mixing
from lightning_fedshard.core.transport.topology import FederationTopology
from lightning_fedshard.core.wire.codecs import SparseTopK
from lightning_fedshard.core.wire.reducers import AllReduceSum, Reducer
from lightning_fedshard.plan.framing import (
    allgather_messages,
    alltoall_messages,
    framed_bytes,
    ring_allreduce_messages,
)
from lightning_fedshard.plan.specs import GIB, ClusterSpec, ModelSpec, TrainSetup

#: Messages one rank sends over its ring edge in one call, as (share of the edge's payload, messages) parts.
Messages = Sequence[tuple[float, float]]
#: Bytes of one value of the sync's statistics sums (float64).
STATS_VALUE_BYTES = 8
#: Values of the norms sum of a sync (own squared norm, mean dot product, mean squared norm).
NORM_VALUES = 3


@dataclass(frozen=True)
class Collective:
    """One kind of collective of a step or a sync, over all the rings that run it at the same time.

    Attributes:
        name: What it moves, e.g. ``"all-gather (forward)"``.
        seconds: Time of one call.
        node_bytes: Payload bytes the busiest node sends into the network in one call.
        link_bytes: Bytes all nodes together send into the network in one call (what link counters show): the
            payload, plus its framing on a cluster with a ``tcp_mtu``.
        rank_bytes: Payload bytes one rank sends in one call, over any link.
        calls: Calls per optimizer step (per sync for outer collectives).
        crosses_nodes: Whether any ring edge leaves a node.
        messages: Messages all nodes together send into the network in one call.
        site_bytes: Payload bytes all sites together send over their uplinks in one call (0 on one site).
    """

    name: str
    seconds: float
    node_bytes: float
    link_bytes: float
    rank_bytes: float
    calls: float
    crosses_nodes: bool
    messages: float = 0.0
    site_bytes: float = 0.0


@dataclass(frozen=True)
class Memory:
    """Bytes per rank (device) and per node (host)."""

    parameters: float
    gradients: float
    optimizer: float
    gathered: float
    activations: float
    host_anchor: float
    host_outer: float
    sync: float = 0.0
    """Device bytes of one fragment's sync: its pseudo-gradient buffer and the temporaries of its sum."""
    sync_overlaps_training: bool = False
    """With ``sync_delay > 0`` or eager updates the sum runs during training steps, so its bytes add to theirs."""

    @property
    def device(self) -> float:
        """The peak on one device: the sharded state, plus training's transients or a sync's (or both, overlapped)."""
        training = self.gathered + self.activations
        transient = training + self.sync if self.sync_overlaps_training else max(training, self.sync)
        return self.parameters + self.gradients + self.optimizer + transient

    @property
    def host(self) -> float:
        """The federation's host memory per rank (anchor, outer optimizer state, residuals)."""
        return self.host_anchor + self.host_outer


@dataclass(frozen=True)
class SyncLevel:
    """One kind of sync of the outer topology and how often it happens.

    Attributes:
        name: E.g. ``"all groups"``, ``"sites of 2 groups"``, ``"gossip (mean over 16 rounds)"``.
        per_step: Syncs of this kind per optimizer step (``fragments / sync_every`` for the default topology).
        collectives: What one such sync sends.
    """

    name: str
    per_step: float
    collectives: list[Collective]

    @property
    def seconds(self) -> float:
        """Time of one such sync."""
        return sum(c.seconds for c in self.collectives)

    @property
    def link_bytes(self) -> float:
        """Bytes all nodes send into the network in one such sync."""
        return sum(c.link_bytes * c.calls for c in self.collectives)

    @property
    def site_bytes(self) -> float:
        """Payload bytes all sites send over their uplinks in one such sync."""
        return sum(c.site_bytes * c.calls for c in self.collectives)


@dataclass(frozen=True)
class Prediction:
    """What one setup does on one cluster, per optimizer step.

    Attributes:
        setup: The setup.
        topology: Its groups, replicas and shards.
        compute_seconds: Forward, backward and optimizer of one step on one rank.
        step_collectives: In-group collectives (per step).
        sync_collectives: The outer sum of one fragment (per landing).
        collective_seconds: In-group collective time per step (exposed or not).
        sync_seconds: Time of one fragment's outer sum.
        exposed_sync_seconds: Outer-sum time per step that training waits for (amortized over ``sync_every``).
        step_seconds: Wall time of one optimizer step, syncs amortized.
        memory: Memory per rank.
        fits: Whether the device memory holds it.
        bottleneck: ``"compute"``, ``"intra-node collectives"``, ``"inter-node collectives"`` or ``"outer sync"``.
        sync_levels: Every kind of sync of the outer topology with its rate (one level for the default topology,
            whose collectives are :attr:`sync_collectives`).
    """

    setup: TrainSetup
    topology: FederationTopology
    cluster: ClusterSpec
    model: ModelSpec
    compute_seconds: float
    step_collectives: list[Collective]
    sync_collectives: list[Collective]
    collective_seconds: float
    sync_seconds: float
    exposed_sync_seconds: float
    step_seconds: float
    memory: Memory
    fits: bool
    bottleneck: str
    notes: list[str] = field(default_factory=list)
    sync_levels: list[SyncLevel] = field(default_factory=list)

    @property
    def sequences_per_step(self) -> int:
        """Sequences all ranks process per optimizer step."""
        return self.topology.world_size * self.setup.micro_batch * self.setup.grad_accum

    @property
    def batch_per_step(self) -> int:
        """Sequences behind one optimizer step (averaged into one update): a group's, or the cluster's."""
        ranks = self.topology.group_size if self.setup.federated else self.topology.world_size
        return ranks * self.setup.micro_batch * self.setup.grad_accum

    @property
    def tokens_per_second(self) -> float:
        """Tokens all ranks process per second."""
        return self.sequences_per_step * self.model.seq_len / self.step_seconds

    @property
    def sequences_per_second(self) -> float:
        """Sequences all ranks process per second."""
        return self.sequences_per_step / self.step_seconds

    @property
    def compute_utilization(self) -> float:
        """Share of a step spent computing."""
        return self.compute_seconds / self.step_seconds

    @property
    def link_bytes_per_step(self) -> float:
        """Bytes all nodes send into the network per optimizer step, syncs amortized (the link counters' view)."""
        step = sum(c.link_bytes * c.calls for c in self.step_collectives)
        return step + sum(level.link_bytes * level.per_step for level in self.sync_levels)

    @property
    def link_bytes_per_sync(self) -> float:
        """Bytes all nodes send into the network per landing of one fragment."""
        return sum(c.link_bytes * c.calls for c in self.sync_collectives)

    @property
    def advice(self) -> str | None:
        """For a setup that does not fit in device memory, what would make it fit (``None`` when it fits)."""
        return None if self.fits else memory_advice(self.model, self.cluster, self.setup, self.topology)


def topology_of(setup: TrainSetup, cluster: ClusterSpec) -> FederationTopology:
    """Groups, replicas and shards of ``setup`` (the strategy's own validation and defaults).

    Raises:
        ValueError: If the ranks cannot be cut so, with the strategy's message.
    """
    num_groups = (
        (setup.federation.num_groups or (cluster.num_nodes if setup.strategy == "fl_fsdp" else 2))
        if setup.federated
        else 1
    )
    config = FederationConfig(num_groups=num_groups, shard_size=setup.federation.shard_size if setup.hybrid else None)
    topology = config.topology(cluster.num_nodes, cluster.devices_per_node, setup.hybrid)
    if setup.federated and (outer := setup.federation.hierarchical or setup.federation.mixing) is not None:
        outer.check_groups(topology.num_groups)  # the strategy's own check of the groups against the topology
    return topology


def ring(
    name: str,
    rings: Sequence[Sequence[int]],
    tensor_bytes: float,
    factor: float,
    calls: float,
    cluster: ClusterSpec,
    pieces: int = 1,
    messages: Messages = (),
) -> Collective:
    """A ring collective run by several rings at once, each on ``tensor_bytes`` (its whole tensor).

    Args:
        name: Label.
        rings: The global ranks of every ring, in ring order.
        tensor_bytes: ``V``, the size of the whole tensor of one ring.
        factor: 1 for all-gather / reduce-scatter, 2 for all-reduce.
        calls: Calls per step.
        cluster: Where the ranks live.
        pieces: Separate calls the tensor is moved in (one per FSDP unit), each paying the ring's latency.
        messages: The messages one rank sends over its ring edge in one call (all pieces), as ``(share of the
            edge's payload, messages)`` parts; each part is framed on its own on a cluster with a ``tcp_mtu``.
    """
    frozen_rings = tuple(tuple(members) for members in rings)
    return _ring(name, frozen_rings, tensor_bytes, factor, calls, cluster, pieces, tuple(messages))


@functools.lru_cache(maxsize=4096)
def _ring(
    name: str,
    rings: tuple[tuple[int, ...], ...],
    tensor_bytes: float,
    factor: float,
    calls: float,
    cluster: ClusterSpec,
    pieces: int,
    messages: tuple[tuple[float, float], ...],
) -> Collective:
    """:func:`ring`, remembered: a sweep asks for the same collective of the same layout for every option it tries."""
    edges: list[tuple[int, int, float]] = []
    steps = 0
    for members in rings:
        n = len(members)
        if n < 2:
            continue
        per_edge = factor * (n - 1) / n * tensor_bytes
        steps = max(steps, int(factor) * (n - 1))
        edges += [(rank, members[(i + 1) % n], per_edge) for i, rank in enumerate(members)]
    return _edges(name, edges, calls, cluster, pieces * steps, messages)


def exchange(
    name: str, sends: Sequence[tuple[int, int]], message_bytes: float, cluster: ClusterSpec, calls: float = 1.0
) -> Collective:
    """Point-to-point messages of ``message_bytes`` each, ``(sender, receiver)`` global ranks, all at once."""
    return _edges(name, [(a, b, message_bytes) for a, b in sends], calls, cluster, 1, ((1.0, 1),))


def _edges(
    name: str,
    edges: Sequence[tuple[int, int, float]],
    calls: float,
    cluster: ClusterSpec,
    latency_steps: int,
    messages: Messages,
) -> Collective:
    """A collective that sends ``bytes`` over every ``(sender, receiver, bytes)`` edge at the same time.

    Edges that leave a node share the node's network bandwidth; edges that leave a site also share the site's uplink
    (each direction), so the slowest of the node links, the uplinks and the busiest rank's intra-node edges decides.
    """
    node_out: dict[int, float] = defaultdict(float)
    site_out: dict[int, float] = defaultdict(float)
    site_in: dict[int, float] = defaultdict(float)
    rank_out: dict[int, float] = defaultdict(float)
    intra_out: dict[int, float] = defaultdict(float)
    link = sent = 0.0
    crosses = crosses_sites = False
    for sender, receiver, nbytes in edges:
        rank_out[sender] += nbytes
        node, other = sender // cluster.devices_per_node, receiver // cluster.devices_per_node
        if node == other:
            intra_out[sender] += nbytes
            continue
        node_out[node] += nbytes
        link += _on_the_link(nbytes, messages, cluster)
        sent += sum(count for _, count in messages)
        crosses = True
        if cluster.site_of(node) != cluster.site_of(other):
            site_out[cluster.site_of(node)] += nbytes
            site_in[cluster.site_of(other)] += nbytes
            crosses_sites = True
    network = max(node_out.values(), default=0.0) / cluster.inter_bandwidth
    uplink = max([*site_out.values(), *site_in.values()], default=0.0) / (cluster.site_bandwidth or math.inf)
    intra = max(intra_out.values(), default=0.0) / cluster.intra_bandwidth
    if crosses_sites:
        step_latency = max(cluster.inter_latency, cluster.site_latency)
    else:
        step_latency = cluster.inter_latency if crosses else cluster.intra_latency
    return Collective(
        name,
        max(network, uplink, intra) + latency_steps * step_latency,
        max(node_out.values(), default=0.0),
        link,
        max(rank_out.values(), default=0.0),
        calls,
        crosses,
        sent,
        sum(site_out.values()),
    )


def _on_the_link(payload: float, messages: Messages, cluster: ClusterSpec) -> float:
    """What a link counter sees of ``payload`` sent as ``messages`` (the payload alone without a ``tcp_mtu``)."""
    if cluster.tcp_mtu is None or not messages or payload == 0:
        return payload
    return sum(framed_bytes(share * payload, count, cluster.tcp_mtu) for share, count in messages)


@functools.lru_cache(maxsize=256)
def _rings(t: FederationTopology, axis: str) -> tuple[tuple[int, ...], ...]:
    """The rings of ``t`` along ``axis``, each in ring order, remembered per topology.

    ``"shard"``: by group, then replica; ``"replicate"``: by group, then shard; ``"fed"``: by replica, then shard.
    """
    if axis == "shard":
        return tuple(tuple(t.shard_ranks(g, r)) for g in range(t.num_groups) for r in range(t.num_replicas))
    if axis == "replicate":
        return tuple(tuple(t.replicate_ranks(g, s)) for g in range(t.num_groups) for s in range(t.shard_size))
    return tuple(tuple(t.fed_ranks(r, s)) for r in range(t.num_replicas) for s in range(t.shard_size))


def step_collectives(model: ModelSpec, setup: TrainSetup, t: FederationTopology, c: ClusterSpec) -> list[Collective]:
    """The in-group collectives of one optimizer step (every micro-batch gathers and reduces again).

    Sharded units are gathered in the forward and again in the backward pass; the root unit (embeddings, output)
    stays gathered from forward to backward. Gradients are reduce-scattered over the shard ranks (gloo: an
    all-reduce), then all-reduced over the replicas (HSDP). Messages are counted per unit with the average unit.
    """
    shard_rings = _rings(t, "shard")
    accum = setup.grad_accum
    layers = model.num_parameters - model.root_parameters
    gather = (2 * layers + model.root_parameters) * setup.param_bytes
    scatter_factor = 2.0 if c.gloo_reduce_scatter else 1.0
    collectives = []
    units = model.num_layers + 1
    if (s := t.shard_size) > 1:
        gathers = 2 * units - 1
        messages = ((1.0, gathers * allgather_messages(s)),)
        collectives.append(ring("all-gather (parameters)", shard_rings, gather, 1.0, accum, c, gathers, messages))
        name = "reduce-scatter (gradients)" + (", as all-reduce" if c.gloo_reduce_scatter else "")
        grads = model.num_parameters * setup.grad_bytes
        per_unit = ring_allreduce_messages(math.ceil(grads / units), s, setup.grad_bytes)
        if not c.gloo_reduce_scatter:  # the reduce-scatter half of the ring
            per_unit /= 2
        scatter = ring(name, shard_rings, grads, scatter_factor, accum, c, units, ((1.0, units * per_unit),))
        collectives.append(scatter)
    if (replicas := t.num_replicas) > 1:
        replica_rings = _rings(t, "replicate")
        shard_grads = model.num_parameters * setup.grad_bytes / t.shard_size
        per_unit = ring_allreduce_messages(math.ceil(shard_grads / units), replicas, setup.grad_bytes)
        collectives.append(
            ring(
                "all-reduce (gradients over replicas)",
                replica_rings,
                shard_grads,
                2.0,
                accum,
                c,
                units,
                ((1.0, units * per_unit),),
            )
        )
    return collectives


def sync_collectives(model: ModelSpec, setup: TrainSetup, t: FederationTopology, c: ClusterSpec) -> list[Collective]:
    """The outer sum of one fragment over the ``"fed"`` axis, with the bytes the core's reducer sends.

    With ``R`` replicas (FL+HSDP) each replica sums ``1 / R`` of its shard over the groups, then the replicas gather
    the summed parts inside the group (in the reducer's output dtype: float32, or the float wire dtype). Every sync
    also sums two float64 statistics vectors, first over the fed ring, then inside the group: the NaN/Inf flags
    (one per group, when the sum begins) and three norms (when it lands).
    """
    if not setup.federated or (groups := t.num_groups) < 2:
        return []
    reducer = setup.federation.reducer()
    numel = math.ceil(model.num_parameters / t.shard_size / setup.federation.fragments)
    part = math.ceil(numel / t.num_replicas)
    per_rank = reducer.wire_bytes(part, groups)
    fed_rings = _rings(t, "fed")
    # Express the reducer's bytes as a ring all-gather-like collective of the same per-rank volume.
    tensor = per_rank * groups / (groups - 1)
    if isinstance(reducer, AllReduceSum):  # gloo's ring all-reduce of the values in the wire dtype
        size = reducer.codec.element_size
        messages: Messages = ((1.0, ring_allreduce_messages(part * size, groups, size)),)
    else:  # all-to-all of G pieces, then all-gather of the summed ones (in halves): half of the bytes each
        messages = ((0.5, alltoall_messages(groups)), (0.5, allgather_messages(groups)))
    collectives = [
        ring(f"outer sum ({setup.federation.codec.describe()})", fed_rings, tensor, 1.0, 1.0, c, 1, messages)
    ]
    if t.num_replicas > 1:  # the summed parts, still encoded, gathered inside the group
        replica_rings = _rings(t, "replicate")
        gathered = t.num_replicas * reducer.encoded_bytes(part, groups)
        gather = ((1.0, allgather_messages(t.num_replicas)),)
        collectives.append(ring("outer sum: gather over replicas", replica_rings, gathered, 1.0, 1.0, c, 1, gather))
    stats = (groups, NORM_VALUES)  # values of the two sums
    collectives.append(_stats_sums("sync statistics: sums over the fed ring", fed_rings, groups, stats, c))
    if t.shard_size > 1:
        shard_rings = _rings(t, "shard")
        collectives.append(_stats_sums("sync statistics: sums in the group", shard_rings, t.shard_size, stats, c))
    return collectives


#: Rounds of a mixing topology's seeded schedule the planner averages over.
MIXING_ROUNDS = 16


def sync_levels(model: ModelSpec, setup: TrainSetup, t: FederationTopology, c: ClusterSpec) -> list[SyncLevel]:
    """Every kind of sync of ``setup``'s outer topology, what one sends and how often it happens per step.

    The default topology has one: the outer sum of a fragment, ``fragments / sync_every`` times per step. A
    hierarchical level of ``k < G`` groups is a float32 ring all-reduce over each block (one ring per block and fed
    ring), and its rate is the share of steps whose largest dividing period is that level's. A mixing round sends each
    group's float32 shards to every group that takes a share of them (point to point), averaged over
    :data:`MIXING_ROUNDS` rounds of the seeded schedule; a uniform round is the default outer sum.
    """
    federation = setup.federation
    outer = sync_collectives(model, setup, t, c)
    if not outer:
        return []
    hierarchical, mixing = federation.hierarchical, federation.mixing
    if hierarchical is not None:
        numel = math.ceil(model.num_parameters / t.shard_size)
        rates = _level_rates(list(hierarchical.levels))
        levels = []
        for period, size in hierarchical.levels.items():
            if size >= t.num_groups:
                levels.append(SyncLevel(f"all {t.num_groups} groups", rates[period], outer))
                continue
            rings = [
                sorted(t.fed_ranks(r, s)[g] for g in block)
                for r in range(t.num_replicas)
                for s in range(t.shard_size)
                for block in hierarchical.blocks(size, t.num_groups)
            ]
            messages = ((1.0, ring_allreduce_messages(numel * 4, size, 4)),)
            site = ring(f"site average ({size} groups, float32)", rings, numel * 4.0, 2.0, 1.0, c, 1, messages)
            levels.append(SyncLevel(f"sites of {size} groups", rates[period], [site]))
        return levels
    if mixing is not None:
        return [_mixing_level(mixing, model, t, c, federation.sync_every, outer)]
    return [SyncLevel("all groups", federation.fragments / federation.sync_every, outer)]


def _level_rates(periods: list[int]) -> dict[int, float]:
    """For each period, the share of steps at which it is the largest period dividing the step."""
    span = math.lcm(*periods)
    counts = dict.fromkeys(periods, 0)
    for step in range(1, span + 1):
        due = [p for p in periods if step % p == 0]
        if due:
            counts[max(due)] += 1
    return {p: counts[p] / span for p in periods}


def _mixing_level(
    mixing: Mixing, model: ModelSpec, t: FederationTopology, c: ClusterSpec, every: int, outer: list[Collective]
) -> SyncLevel:
    """A mixing's sync, its time and bytes the mean over :data:`MIXING_ROUNDS` rounds."""
    groups = t.num_groups
    message = math.ceil(model.num_parameters / t.shard_size) * 4.0
    rounds = []
    for round in range(MIXING_ROUNDS):
        matrix = mixing.weights(round, groups)
        if bool((matrix - 1.0 / groups).abs().max() <= 1e-12):
            rounds.append(outer)
            continue
        sends = [
            (ring[j], ring[i])
            for r in range(t.num_replicas)
            for s in range(t.shard_size)
            for ring in [t.fed_ranks(r, s)]
            for i in range(groups)
            for j in range(groups)
            if i != j and matrix[i, j] > 0
        ]
        rounds.append([exchange("mix (float32, point to point)", sends, message, c)])
    mean = _mean_collective(f"{mixing.describe()}, mean over {MIXING_ROUNDS} rounds", rounds)
    return SyncLevel(mixing.describe(), 1.0 / every, [mean])


def _mean_collective(name: str, rounds: list[list[Collective]]) -> Collective:
    """One collective whose time and bytes are the means over ``rounds`` of their collectives' totals."""
    n = len(rounds)

    def mean(attribute: str, weighted: bool = True) -> float:
        return sum(getattr(col, attribute) * (col.calls if weighted else 1) for r in rounds for col in r) / n

    return Collective(
        name,
        mean("seconds", weighted=False),
        mean("node_bytes"),
        mean("link_bytes"),
        mean("rank_bytes"),
        1.0,
        any(col.crosses_nodes for r in rounds for col in r),
        mean("messages"),
        mean("site_bytes"),
    )


def _stats_sums(name: str, rings: Sequence[Sequence[int]], n: int, values: Sequence[int], c: ClusterSpec) -> Collective:
    """Small float64 all-reduces over ``rings`` of ``n`` ranks, one per entry of ``values``, as one collective."""
    sizes = [v * STATS_VALUE_BYTES for v in values]
    messages = [(size / sum(sizes), ring_allreduce_messages(size, n, STATS_VALUE_BYTES)) for size in sizes]
    return ring(name, rings, sum(sizes), 2.0, 1.0, c, len(values), messages)


def memory(model: ModelSpec, setup: TrainSetup, t: FederationTopology) -> Memory:
    """Bytes per rank: sharded state, two gathered units, activations and one fragment's sync.

    Sharded state: parameters, gradients and inner optimizer state. On the host: the anchor and the outer optimizer
    state (and int8/int4 residuals, which wait with the anchor).
    """
    shard = model.num_parameters / t.shard_size
    largest_unit = max(model.layer_parameters, model.root_parameters)
    tokens = setup.micro_batch * model.seq_len
    if setup.activation_checkpointing:  # each layer's input, plus one layer's full activations in the backward
        per_layer = 2 * tokens * model.hidden_size
        activations = model.num_layers * per_layer + _layer_activations(model, tokens, setup.flash_attention)
    else:
        activations = model.num_layers * _layer_activations(model, tokens, setup.flash_attention)
    reducer = setup.federation.reducer()
    residuals = 2 if getattr(reducer, "feedback", None) is not None else 0
    eager = setup.federation.eager_rule is not None
    # the outer momentum, the residuals and, with eager updates, each group's start offsets (float32, with the anchor)
    outer_state = (1 if setup.federation.outer_optimizer == "nesterov" else 0) + residuals + (1 if eager else 0)
    federated = setup.federated and t.num_groups > 1
    fragment = shard / setup.federation.fragments
    # With eager updates every fragment has its pseudo-gradient buffer in flight at all times.
    in_flight = (shard - fragment) * reducer.input_dtype.itemsize if eager else 0.0
    return Memory(
        parameters=shard * setup.master_bytes,
        gradients=shard * setup.master_bytes,
        optimizer=shard * setup.optimizer_bytes,
        gathered=2 * largest_unit * setup.param_bytes if t.shard_size > 1 else 0.0,
        activations=activations,
        host_anchor=shard * 4 if federated else 0.0,
        host_outer=shard * 4 * outer_state if federated else 0.0,
        sync=_sync_bytes(reducer, fragment) + in_flight if federated else 0.0,
        sync_overlaps_training=setup.federation.sync_delay > 0 or eager,
    )


def memory_advice(model: ModelSpec, cluster: ClusterSpec, setup: TrainSetup, t: FederationTopology) -> str:
    """What would bring ``setup`` into device memory, by the memory model (:func:`memory`).

    When the sharded state alone is too large: shard over more ranks. Otherwise the transients are: one change, or
    one change of the sync (streaming fragments, each holding ``1 / P`` of the shard at its sync; no overlap of the
    sum with training) together with one of training (activation checkpointing, a smaller micro-batch).
    """
    mem = memory(model, setup, t)
    state = mem.parameters + mem.gradients + mem.optimizer
    limit = cluster.device_memory
    if state > limit:
        return (
            f"the sharded state alone needs {state / GIB:.1f} GiB of {limit / GIB:.1f}: shard over more ranks"
            f" ({'fewer groups or ' if setup.federated else ''}a larger shard)"
        )
    sync, training = list(_sync_changes(model, setup)), list(_training_changes(setup))
    pairs = [
        (f"{a} and {b}", replace(u, federation=s.federation)) for a, s in sync for b, u in training
    ]  # one change of the sync and one of training
    for change, changed in (*sync, *training, *pairs):
        if memory(model, changed, t).device <= limit:
            return f"try {change}"
    transient = (mem.device - state) / GIB
    return f"over by {(mem.device - limit) / GIB:.1f} GiB with {transient:.1f} GiB of transients: shard over more ranks"


def _sync_changes(model: ModelSpec, setup: TrainSetup) -> Iterator[tuple[str, TrainSetup]]:
    """Changes of the federation that lower a sync's device memory, as ``(what to try, the changed setup)``."""
    federation = setup.federation
    if not setup.federated:
        return
    units = model.num_layers + 1  # a fragment is made of whole FSDP units: one per layer and the root
    more = range(federation.fragments + 1, min(federation.sync_every, units) + 1)
    for fragments in (p for p in more if federation.sync_every % p == 0):
        try:
            changed = replace(federation, fragments=fragments)
        except ValueError:  # e.g. a sync_delay too long for the shorter interval, or an outer topology
            continue
        yield f"fragments={fragments}", replace(setup, federation=changed)
    if federation.sync_delay or federation.eager_rule is not None:
        overlap = "sync_delay=0" if federation.sync_delay else "eager_updates=false"
        yield overlap, replace(setup, federation=replace(federation, sync_delay=0, eager_updates=False))


def _training_changes(setup: TrainSetup) -> Iterator[tuple[str, TrainSetup]]:
    """Changes of training that lower its activations, as ``(what to try, the changed setup)``."""
    if not setup.activation_checkpointing:
        yield "activation_checkpointing=true", replace(setup, activation_checkpointing=True)
    micro_batch = setup.micro_batch // 2
    while micro_batch >= 1:
        yield f"micro_batch={micro_batch}", replace(setup, micro_batch=micro_batch)
        micro_batch //= 2


def _sync_bytes(reducer: Reducer, local: float) -> float:
    """Device bytes of one fragment's sync over ``local`` values of this rank.

    A float reduce holds the buffer in ``reduce_dtype`` and, below float32, the float32 result. int8 / int4 hold the
    float32 buffer, its padded copy and the quantization's float32 temporaries (``core/wire/reducers.py``): about three
    float32 copies at the peak. The sparse codec's top-k adds the magnitudes (4 bytes per value), an int32 running
    count of ties (4) and three masks (1 each): about five float32 copies.
    """
    if isinstance(reducer, AllReduceSum):
        size = reducer.codec.element_size
        return local * (size + (4 if size < 4 else 0))
    if isinstance(reducer.codec, SparseTopK):
        return local * (4 * 3 + 4 + 4 + 3)
    return local * 4 * 3


def _layer_activations(model: ModelSpec, tokens: int, flash_attention: bool) -> float:
    # Korthikanti et al. (2022), 16-bit activations without recomputation: T b h (34 + 5 a T / h) bytes per layer;
    # fused attention (flash / SDPA) keeps no T x T score matrix, which drops the second term.
    scores = 0.0 if flash_attention else 5 * model.num_heads * model.seq_len / model.hidden_size
    return tokens * model.hidden_size * (34 + scores)


def exposed_sync_seconds(federation: FederationConfig, sync: float, inner: float) -> float:
    """Seconds per optimizer step that training waits for syncs, each taking ``sync`` seconds, steps ``inner``.

    A fragment lands every ``H / F`` steps. With ``sync_delay = d`` its sum travels while ``d`` steps train and the
    rest is exposed. With eager updates every fragment's sum has a whole round (``H`` steps) to land, but the ``F``
    sums of a round queue on one background thread and one link: the round waits only for what ``F`` sums take
    beyond ``H`` steps of training.
    """
    h, f = federation.sync_every, federation.fragments
    if federation.eager_rule is not None:
        return max(0.0, f * sync - h * inner) / h
    return max(0.0, sync - federation.sync_delay * inner) * f / h


def compute_seconds(model: ModelSpec, setup: TrainSetup, cluster: ClusterSpec) -> float:
    """One rank's compute per optimizer step: measured, or FLOPs at the assumed MFU."""
    if cluster.step_seconds is not None:
        return cluster.step_seconds * setup.grad_accum
    tokens = setup.micro_batch * setup.grad_accum * model.seq_len
    return tokens * model.flops_per_token / (cluster.peak_flops * cluster.mfu)


def inner_step_seconds(compute: float, collective: float, cluster: ClusterSpec) -> float:
    """A step's seconds without the outer sync: compute and in-group collectives, overlapped where the cluster does."""
    return max(compute, collective) if cluster.overlap_collectives else compute + collective


def predict(model: ModelSpec, cluster: ClusterSpec, setup: TrainSetup) -> Prediction:
    """Time, traffic, memory and the bottleneck of ``setup`` on ``cluster`` (see the module docstring).

    Raises:
        ValueError: If the topology does not fit the cluster, or an option is invalid (the strategy's own messages).
    """
    t = topology_of(setup, cluster)
    compute = compute_seconds(model, setup, cluster)
    step = step_collectives(model, setup, t, cluster)
    collective = sum(col.seconds * col.calls for col in step)
    inner = inner_step_seconds(compute, collective, cluster)
    syncs = sync_collectives(model, setup, t, cluster)
    sync = sum(col.seconds for col in syncs)
    levels = sync_levels(model, setup, t, cluster)
    if setup.federation.hierarchical is None and setup.federation.mixing is None:
        exposed = exposed_sync_seconds(setup.federation, sync, inner)
    else:  # one fragment without overlap: every sync waits
        exposed = sum(level.seconds * level.per_step for level in levels)
    step_seconds = inner + exposed
    mem = memory(model, setup, t)
    intra = sum(col.seconds * col.calls for col in step if not col.crosses_nodes)
    inter = collective - intra
    parts = {
        "compute": compute,
        "intra-node collectives": intra,
        "inter-node collectives": inter,
        "outer sync": exposed,
    }
    notes = []
    if setup.federated and t.group_size % cluster.devices_per_node and cluster.devices_per_node % t.group_size:
        notes.append("groups do not line up with nodes")
    return Prediction(
        setup=setup,
        topology=t,
        cluster=cluster,
        model=model,
        compute_seconds=compute,
        step_collectives=step,
        sync_collectives=syncs,
        collective_seconds=collective,
        sync_seconds=sync,
        exposed_sync_seconds=exposed,
        step_seconds=step_seconds,
        memory=mem,
        fits=mem.device <= cluster.device_memory,
        bottleneck=max(parts, key=lambda k: parts[k]),
        notes=notes,
        sync_levels=levels,
    )
