"""``fedshard plan``: the planner on the command line (jsonargparse; ``fedshard plan --help`` lists every input)."""

from __future__ import annotations

import inspect
import json as jsonlib
import sys
import typing
from dataclasses import asdict, fields
from typing import Any

from lightning_fedshard.core.config import FederationConfig, args_doc
from lightning_fedshard.plan.hetero import heterogeneous
from lightning_fedshard.plan.inputs import PlannerInputs
from lightning_fedshard.plan.predict import Prediction
from lightning_fedshard.plan.quality import STUDY, tokens_to_target
from lightning_fedshard.plan.specs import GIB, ClusterSpec, TrainSetup
from lightning_fedshard.plan.sweep import compare, relative_time_to_target
from lightning_fedshard.plan.sweep import sweep as sweep_setups


def _plan(federation: FederationConfig, inputs: PlannerInputs) -> list[Prediction]:
    """Predict throughput, traffic, memory and the bottleneck of FSDP, HSDP, FL+FSDP and FL+HSDP before a run.

    Prints a table of the four strategies at the given settings, or with ``--sweep true`` the fastest
    federated configurations (groups x shard size x sync_every x fragments x dtype x delay or eager updates) that fit
    in device memory. The equations, their assumptions and the calibration against measured runs are in docs/plan.md.

    Args:
        federation: The sync options (:func:`plan` takes them as keywords, one per ``FederationConfig`` field).
        inputs: Everything else (:func:`plan` takes them as keywords too, one per ``PlannerInputs`` field).

    Returns:
        The predictions printed.
    """
    spec, machine = inputs.model_spec(), inputs.cluster_spec()
    speeds = inputs.checked_node_speeds(machine.num_nodes)
    base = inputs.setup(federation)
    if inputs.sweep:
        predictions = sweep_setups(spec, machine, base, top=inputs.top, rank=inputs.rank, node_speeds=speeds)
    else:
        predictions = compare(spec, machine, base)
    if inputs.json:
        print(to_json(predictions, speeds))
    else:
        ranked = inputs.rank if inputs.sweep else None
        print(table(predictions, ranked=ranked, node_speeds=speeds if inputs.sweep else None))
        if speeds is not None:
            print("\n" + heterogeneous_table(predictions, speeds))
    return predictions


def plan(**options: Any) -> list[Prediction]:
    """The planner with the sync options as keywords: see the signature and ``fedshard plan --help``."""
    names = {f.name for f in fields(FederationConfig)}
    federation = FederationConfig(**{k: v for k, v in options.items() if k in names})
    return _plan(federation, PlannerInputs(**{k: v for k, v in options.items() if k not in names}))


def _keywords(options: type) -> list[inspect.Parameter]:
    """Every field of a dataclass of options as a keyword of :func:`plan`, with its type and default."""
    hints = typing.get_type_hints(options)
    return [
        inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=hints[f.name])
        for f in fields(options)
    ]


def _plan_signature() -> inspect.Signature:
    """The planner's own inputs, then the federation's: the one signature of :func:`plan` (and of its command)."""
    return inspect.Signature(
        [*_keywords(PlannerInputs), *_keywords(FederationConfig)], return_annotation=list[Prediction]
    )


def _plan_doc() -> str:
    """:func:`_plan`'s description and ``Returns:``, with the entries of both its inputs' fields as ``Args:``."""
    doc = _plan.__doc__ or ""
    description, returns = doc.partition("\n\n    Args:")[0], doc.partition("\n    Returns:")[2].rstrip()
    args = f"{args_doc(PlannerInputs)}\n{args_doc(FederationConfig)}"
    return f"{description}\n\n    Args:\n{args}\n\n    Returns:{returns}"


plan.__signature__ = _plan_signature()  # type: ignore[attr-defined]
plan.__doc__ = _plan_doc()


def heterogeneous_table(predictions: list[Prediction], node_speeds: list[float]) -> str:
    """The federated rows' tokens/s with nodes of these speeds: barrier, per-group pace, attainable."""
    shown = ", ".join(f"{v:g}" for v in node_speeds)
    rows = [
        f"With node speeds {shown} (docs/pace.md):\n",
        "| strategy | groups x replicas x shards | barrier tokens/s | per-group pace tokens/s | attainable"
        " | pace steps |",
        "|---|---|---|---|---|---|",
    ]
    for p in predictions:
        h = heterogeneous(p, node_speeds)
        if h is not None:
            t = p.topology
            rows.append(
                f"| {p.setup.strategy} | {t.num_groups} x {t.num_replicas} x {t.shard_size} | {h.barrier:,.0f} |"
                f" {h.pace:,.0f} | {h.attainable:,.0f} | {'/'.join(map(str, h.steps))} |"
            )
    return "\n".join(rows)


def summary(p: Prediction) -> dict[str, Any]:
    """One prediction as a flat dict (the JSON output and the table's rows)."""
    s = p.setup
    return {
        "strategy": s.strategy,
        "topology": str(p.topology),
        "sync_every": s.federation.sync_every if s.federated else None,
        "fragments": s.federation.fragments if s.federated else None,
        "sync_delay": s.federation.sync_delay if s.federated else None,
        "eager_updates": s.federation.eager_updates if s.federated else None,
        "reduce_dtype": s.federation.effective_reduce_dtype if s.federated else None,
        "step_seconds": p.step_seconds,
        "compute_seconds": p.compute_seconds,
        "collective_seconds": p.collective_seconds,
        "sync_seconds": p.sync_seconds,
        "exposed_sync_seconds_per_step": p.exposed_sync_seconds,
        "tokens_per_second": p.tokens_per_second,
        "sequences_per_second": p.sequences_per_second,
        "compute_utilization": p.compute_utilization,
        "link_bytes_per_step": p.link_bytes_per_step,
        "link_bytes_per_sync": p.link_bytes_per_sync,
        "device_memory_bytes": p.memory.device,
        "host_memory_bytes_per_rank": p.memory.host,
        "memory": asdict(p.memory),
        "fits": p.fits,
        "advice": p.advice,
        **_time_to_target(p),
        "outer_topology": outer_topology_of(p.setup),
        "sites": sites_of(p.cluster),
        "batch_per_step": p.batch_per_step,
        "bottleneck": p.bottleneck,
        "collectives": [asdict(c) for c in (*p.step_collectives, *p.sync_collectives)],
        "sync_levels": [
            {
                "name": level.name,
                "per_step": level.per_step,
                "seconds": level.seconds,
                "link_bytes": level.link_bytes,
                "site_bytes": level.site_bytes,
            }
            for level in p.sync_levels
        ],
    }


def to_json(predictions: list[Prediction], node_speeds: list[float] | None = None) -> str:
    """The predictions as a JSON list (with ``node_speeds``, each federated row's ``heterogeneous`` pace)."""
    rows = []
    for p in predictions:
        row = summary(p)
        if node_speeds is not None:
            h = heterogeneous(p, node_speeds)
            row["heterogeneous"] = None if h is None else asdict(h)
        rows.append(row)
    return jsonlib.dumps(rows, indent=1)


#: Under a ``--sweep`` table: what its order means and what it leaves out, by what it ranks by.
RANKING_NOTES = {
    "tokens_per_s": (
        "Ranked by predicted tokens/s only (within 0.5%: fewer link bytes first). Quality is not predicted: a larger"
        " sync_every, more fragments or a coarser reduce_dtype may cost perplexity per token; see docs/benchmarks.md"
        " for measured costs."
    ),
    "time_to_target": (
        "Ranked by predicted time to a target loss where measured: tokens/s over the tokens-to-target factor of the"
        " row's sync options (the tokens to plain FSDP's final loss over FSDP's: FSDP = 1), measured only on {study};"
        " a factor marked * is measured at the recipe's own final loss, a looser target than FSDP's that some seed did"
        " not reach (at the real target it is larger). Plain FSDP over the whole cluster is ranked with them (its row"
        " is shown below the top ones where it ranks lower). Rows whose options it did not measure follow, by"
        " predicted tokens/s. See docs/benchmarks/recipes.md (the recipe study)."
    ),
}
#: Under a sweep ranked with ``--node_speeds``.
NODE_SPEEDS_NOTE = (
    "Tokens/s in the ranking are the barrier's with node speeds {speeds} (every group waits for the slowest at each"
    " sync; the table below gives the per-group pace too): a slow node slows compute-bound rows more than link-bound"
    " ones. The tokens/s column is the all-equal cluster's."
)


def _time_to_target(p: Prediction) -> dict[str, Any]:
    measured = tokens_to_target(p.setup)
    if measured is None:
        return {"tokens_to_target_factor": None, "tokens_to_target_recipe": None}
    return {"tokens_to_target_factor": measured.factor, "tokens_to_target_recipe": measured.recipe}


def outer_topology_of(setup: TrainSetup) -> str:
    """The outer topology the federated rows assume, in words."""
    federation = setup.federation
    topology = federation.hierarchical or federation.mixing
    return "all groups at every sync" if topology is None else topology.describe()


def sites_of(cluster: ClusterSpec) -> str:
    """The sites the cluster is made of, in words."""
    if cluster.nodes_per_site is None:
        return "one (every node on one network)"
    sites = cluster.num_nodes // cluster.nodes_per_site
    uplink = (cluster.site_bandwidth or 0.0) * 8 / 1e6
    return f"{sites} of {cluster.nodes_per_site} nodes, {uplink:,.4g} Mbit/s uplinks"


def _fits(p: Prediction) -> str:
    return "yes" if p.fits else f"no: {p.advice}"


def table(predictions: list[Prediction], ranked: str | None = None, node_speeds: list[float] | None = None) -> str:
    """The predictions as a Markdown table, under the model, cluster, outer topology and sites they assume.

    Args:
        predictions: The rows.
        ranked: The rows are a sweep's ranking by this (``"tokens_per_s"`` or ``"time_to_target"``): say what it
            ranks by and what it leaves out; by time to target, a column shows it (relative to the best row's).
        node_speeds: The nodes' relative speeds the ranking used (the barrier's tokens/s with those speeds).
    """
    if not predictions:
        return "No configuration fits."
    ttt = ranked == "time_to_target"
    p0 = predictions[0]
    head = (
        f"{p0.model.name} ({p0.model.num_parameters / 1e9:.3g} B parameters, {p0.model.seq_len} tokens) on"
        f" {p0.cluster.name} ({p0.cluster.num_nodes} x {p0.cluster.devices_per_node} ranks)\n"
        f"outer topology: {outer_topology_of(p0.setup)}; sites: {sites_of(p0.cluster)}\n\n"
        "| strategy | groups x replicas x shards | H / frag / delay / dtype | step s | tokens/s | seq/s | compute util."
        f" | link GB/step | GiB/rank | fits | batch/step | bottleneck |{_TTT_HEAD if ttt else ''}\n"
        + "|---" * (13 if ttt else 12)
        + "|"
    )
    rows = []
    times = [relative_time_to_target(p, node_speeds) for p in predictions]
    fastest = min((t for t in times if t is not None), default=None)
    for p, time in zip(predictions, times):
        s, t = p.setup, p.topology
        f = s.federation
        delay = f"eager ({f.eager_rule})" if f.eager_rule else f.sync_delay
        fed = f"{f.sync_every} / {f.fragments} / {delay} / {f.effective_reduce_dtype}" if s.federated else "-"
        rows.append(
            f"| {s.strategy} | {t.num_groups} x {t.num_replicas} x {t.shard_size} | {fed} | {p.step_seconds:.3g} |"
            f" {p.tokens_per_second:,.0f} | {p.sequences_per_second:,.1f} | {p.compute_utilization:.2f} |"
            f" {p.link_bytes_per_step / 1e9:.3g} | {p.memory.device / GIB:.1f} | {_fits(p)} |"
            f" {p.batch_per_step:,} | {p.bottleneck} |" + (f" {_ttt_cell(time, fastest, p)} |" if ttt else "")
        )
    note = RANKING_NOTES[ranked].format(study=STUDY) if ranked else None
    if note and node_speeds is not None:
        note += " " + NODE_SPEEDS_NOTE.format(speeds=", ".join(f"{v:g}" for v in node_speeds))
    return "\n".join([head, *rows, *(["", note] if note else [])])


_TTT_HEAD = " time to target |"


def _ttt_cell(time: float | None, fastest: float | None, p: Prediction) -> str:
    if time is None or fastest is None:
        return "not measured"
    measured = tokens_to_target(p.setup)
    assert measured is not None
    return f"{time / fastest:.2f}x ({measured.factor:.3f}{'*' if measured.looser else ''} tokens)"


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``fedshard plan`` (``argv`` without the ``plan`` word)."""
    from jsonargparse import CLI

    from lightning_fedshard.cli import ShortErrorParser

    args = bracketed_lists(sys.argv[2:] if argv is None else argv)
    try:
        CLI(plan, args=args, as_positional=False, parser_class=ShortErrorParser, prog="fedshard plan")
    except ValueError as error:  # bad input: one line naming the value, no traceback
        raise SystemExit(f"fedshard plan: error: {error}") from None


def _list_inputs() -> set[str]:
    """The options of the planner's inputs that take a list (``--node_speeds``)."""
    hints = typing.get_type_hints(PlannerInputs)
    return {
        f"--{f.name}"
        for f in fields(PlannerInputs)
        if any(typing.get_origin(t) is list for t in (typing.get_args(hints[f.name]) or (hints[f.name],)))
    }


def bracketed_lists(argv: list[str]) -> list[str]:
    """``argv`` with each list input given as comma-separated values (``--node_speeds 1,1,1,0.5``) in brackets.

    jsonargparse reads a list in YAML's form (``[1,1,1,0.5]``); a value given so already, or ``null``, is kept.
    """
    lists = _list_inputs()
    out = []
    for i, arg in enumerate(argv):
        option, equals, value = arg.partition("=")
        if equals and option in lists:
            out.append(f"{option}={_bracketed(value)}")
        elif i > 0 and argv[i - 1] in lists and not arg.startswith("--"):
            out.append(_bracketed(arg))
        else:
            out.append(arg)
    return out


def _bracketed(value: str) -> str:
    """``1,1,0.5`` as ``[1,1,0.5]``; a list in brackets, ``null`` or nothing as given."""
    bare = value.strip()
    return value if not bare or bare.startswith("[") or bare.lower() in ("null", "none") else f"[{bare}]"
