"""Elastic federations through faults: their targets, their table and a plot.

Input: ``python -m benchmarks.elastic`` (``benchmarks/results/elastic.json``): per repeat a fault-free and a faulted
run of the elastic federation (4 one-node groups of 2 ranks, 50 Mbit/s), a killed-and-restarted group, and the
single job stopped and restarted from a checkpoint, interleaved.

- **goodput** of a faulted run: its committed tokens/s divided by (the fault-free run's committed tokens/s of the same
  repeat x the faulted run's mean fraction of groups alive). Committed tokens count every round that a committed
  sync closed, per group that contributed to it; a group is alive from its job's start until it is killed or stopped,
  so the start-up time of a job that replaces a group counts as alive. Median over repeats; a repeat whose fault-free
  run lost a group anyway (a job failed, or a sync went on without a group) gives no baseline and is left out.
  Beside it: the committed tokens over the tokens the groups trained (the work the faults threw away), and how long
  a replacing job took to start (launch to asking to join) and to join (waiting for the next sync, healing).
- **stall** of a fault: how much longer the surviving groups' first sync after it took than their median sync
  before it (the largest over survivors).
- **time to N steps**: from the first launch until the federation finished ``N`` steps (its last group's end),
  start-ups included; the elastic run's over the single job's (whose restart from the checkpoint is included), per
  repeat, then the median.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from benchmarks.reports import plotting
from lightning_fedshard.examples.elastic import BATCH, SEQ_LEN, committed_group_steps

GOODPUT_BOUND = 0.95
#: A standby's takeover is bounded by one round (the next sync) plus this many seconds.
TAKEOVER_SLACK_S = 2.0
#: A hung group's cost to the others is bounded by the grace window (the lighthouse's heartbeat timeout) plus this.
STRAGGLER_SLACK_S = 1.0
TARGET_IDS = ("elastic-goodput", "elastic-stall-kill-s", "elastic-vs-restart")
STANDBY_TARGET_IDS = ("standby-join-s", "straggler-stall-s")

Row = dict[str, Any]


def _runs(results: dict[str, Any], kind: str) -> dict[int, dict[str, Any]]:
    return {run["repeat"]: run["result"] for run in results["runs"] if run["kind"] == kind}


def disturbed(run: dict[str, Any]) -> bool:
    """Whether a fault-free run lost a group anyway (a job that failed, or a sync without every group)."""
    groups = set(range(run["config"]["groups"]))
    jobs_failed = any(job["exit_code"] != 0 for group in run["groups"] for job in group["jobs"])
    return jobs_failed or any(set(sync["members"]) != groups for sync in run["syncs"])


def disturbed_repeats(results: dict[str, Any]) -> list[int]:
    """The repeats whose fault-free run lost a group: they give no baseline, and no goodput."""
    return [repeat for repeat, run in sorted(_runs(results, "faultfree").items()) if disturbed(run)]


def goodputs(results: dict[str, Any], kind: str = "faulted") -> list[float]:
    """Every repeat's goodput (a ``kind`` run against the fault-free run of the same repeat, where that one was)."""
    free, faulted = _runs(results, "faultfree"), _runs(results, kind)
    values = []
    for repeat, run in sorted(faulted.items()):
        if repeat in free and not disturbed(free[repeat]):
            expected = free[repeat]["committed_tokens_per_s"] * run["alive_fraction"]
            values.append(run["committed_tokens_per_s"] / expected)
    return values


def committed_shares(results: dict[str, Any], kind: str = "faulted") -> list[float]:
    """Per faulted run, the committed tokens over the tokens its groups trained (the work the faults threw away)."""
    return [
        run["committed_tokens"] / run["trained_tokens"]
        for _, run in sorted(_runs(results, kind).items())
        if run.get("trained_tokens")
    ]


def replacements(results: dict[str, Any], key: str) -> list[float]:
    """``key`` (``start_up_seconds`` or ``join_seconds``) of every job that replaced a group in the faulted runs."""
    return [
        job[key]
        for run in _runs(results, "faulted").values()
        for group in run["groups"]
        for job in group["jobs"][1:]
        if job.get(key) is not None
    ]


def stalls(results: dict[str, Any], kind: str, run_kind: str = "faulted") -> list[float]:
    """The survivors' stall after every fault of ``kind`` in every ``run_kind`` run."""
    return [
        f["stall_seconds"]
        for run in _runs(results, run_kind).values()
        for f in run["faults"]
        if f["kind"] == kind and f["stall_seconds"] is not None
    ]


def takeovers(results: dict[str, Any], ready: bool | None = True) -> list[float]:
    """Standbys' seconds from their group's kill or hang to training in its place, in the standby runs.

    ``ready``: only the standbys that were loaded and waiting when their group died (``True``), only those still
    starting then (``False``: no spare was ready), or all (``None``).
    """
    return [
        job["takeover_seconds"]
        for run in _runs(results, "standby").values()
        for group in run["groups"]
        for job in group["jobs"]
        if job.get("standby")
        and job.get("takeover_seconds") is not None
        and (ready is None or job.get("ready_at_fault") is ready)
    ]


def round_seconds(results: dict[str, Any]) -> float:
    """The median seconds between two syncs of the fault-free runs (one round)."""
    gaps = [
        later["t"] - earlier["t"]
        for run in _runs(results, "faultfree").values()
        for earlier, later in zip(run["syncs"][1:], run["syncs"][2:])  # the first sync closes the start-up
    ]
    return statistics.median(gaps) if gaps else math.nan


def restart_ratios(results: dict[str, Any]) -> list[float]:
    """Per repeat, the elastic run's time to N steps over the single job's (stop and restart from a checkpoint)."""
    elastic, single = _runs(results, "elastic_restart"), _runs(results, "checkpoint_restart")
    return [elastic[r]["finished_seconds"] / single[r]["wall_seconds"] for r in sorted(elastic) if r in single]


def _spread(values: list[float]) -> dict[str, float]:
    if not values:
        return {"median": math.nan, "min": math.nan, "max": math.nan}
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def targets(results: dict[str, Any] | None, standby: dict[str, Any] | None = None) -> list[Row]:
    """The elastic targets, or rows that say the benchmark was not run.

    With ``standby`` (the runs ``--kinds faultfree,standby``), ``elastic-goodput`` is the goodput with standby groups
    (the goodput without them stays beside it), and the standby and straggler targets are added.
    """
    rows = _targets(results)
    if standby is None:
        return rows + [
            _not_run(i, "python -m benchmarks.elastic --kinds faultfree,standby") for i in STANDBY_TARGET_IDS
        ]
    with_standbys = _spread(goodputs(standby, "standby"))
    goodput = rows[0]
    goodput.update(
        {
            "target": "committed tokens/s through kills, hangs and restarts with standby groups over (fault-free"
            " tokens/s x mean fraction of groups alive; a standby counts once it trains), 4 groups x 2 ranks,"
            " 50 Mbit/s",
            "measured": with_standbys["median"],
            "met": with_standbys["median"] >= GOODPUT_BOUND,
            "runs": len(goodputs(standby, "standby")),
            "spread": with_standbys,
            "standbys": standby["standbys"],
            "committed_share_of_trained": _spread(committed_shares(standby, "standby")),
            "without_standbys": {k: goodput.get(k) for k in ("measured", "spread", "runs")},
        }
    )
    round_s = round_seconds(standby)
    joins, hangs = _spread(takeovers(standby)), _spread(stalls(standby, "stop", "standby"))
    late = _spread(takeovers(standby, ready=False))
    config = next(iter(_runs(standby, "standby").values()))["config"]
    return rows + [
        {
            "id": "standby-join-s",
            "target": "a standby's seconds from its group's kill or hang to training in its place (median over the"
            f" standbys that were waiting then), against one round ({round_s:.1f} s, the fault-free runs' median)"
            f" + {TAKEOVER_SLACK_S:g} s",
            "measured": joins["median"],
            "bound": round_s + TAKEOVER_SLACK_S,
            "met": joins["median"] <= round_s + TAKEOVER_SLACK_S,
            "runs": len(takeovers(standby)),
            "spread": joins,
            "no_standby_ready": {"takeovers": len(takeovers(standby, ready=False)), "spread": late},
        },
        {
            "id": "straggler-stall-s",
            "target": "what a hung group (SIGSTOP) costs the others at their next sync (median), against the grace"
            f" window a hung group gets (the lighthouse's heartbeat timeout, {config['heartbeat']:g} s)"
            f" + {STRAGGLER_SLACK_S:g} s",
            "measured": hangs["median"],
            "bound": config["heartbeat"] + STRAGGLER_SLACK_S,
            "met": hangs["median"] <= config["heartbeat"] + STRAGGLER_SLACK_S,
            "runs": len(stalls(standby, "stop", "standby")),
            "spread": hangs,
        },
    ]


def _not_run(target_id: str, command: str) -> Row:
    return {"id": target_id, "target": "elastic benchmark", "measured": None, "bound": None, "met": False, "runs": 0,
            "note": f"not run: {command}"}  # fmt: skip


def _targets(results: dict[str, Any] | None) -> list[Row]:
    """The three targets of the runs without standbys."""
    if results is None:
        return [_not_run(i, "python -m benchmarks.elastic") for i in TARGET_IDS]
    bound = _stall_bound(results)
    goodput, kills = _spread(goodputs(results)), _spread(stalls(results, "kill"))
    ratios = _spread(restart_ratios(results))
    return [
        {
            "id": "elastic-goodput",
            "target": "committed tokens/s through kills, hangs and restarts over (fault-free tokens/s x mean fraction"
            " of groups alive), 4 groups x 2 ranks, 50 Mbit/s",
            "measured": goodput["median"],
            "bound": GOODPUT_BOUND,
            "met": goodput["median"] >= GOODPUT_BOUND,
            "runs": len(goodputs(results)),
            "spread": goodput,
            "faults_per_run": len(results["faults"].split(",")),
            "repeats_without_a_fault_free_baseline": disturbed_repeats(results),
            "committed_share_of_trained": _spread(committed_shares(results)),
            "replacement_start_up_s": _spread(replacements(results, "start_up_seconds")),
            "replacement_join_s": _spread(replacements(results, "join_seconds")),
        },
        {
            "id": "elastic-stall-kill-s",
            "target": "the surviving groups' stall after a group is killed (median; bound on the largest: the"
            " lighthouse's heartbeat timeout plus one quorum's join timeout)",
            "measured": kills["median"],
            "bound": bound,
            "met": kills["max"] <= bound,
            "runs": len(stalls(results, "kill")),
            "spread": kills,
            "stop": _spread(stalls(results, "stop")),
            "restart": _spread(stalls(results, "restart")),
        },
        {
            "id": "elastic-vs-restart",
            "target": "time to N steps with one group killed and replaced: elastic over the single job stopped and"
            " restarted from its last checkpoint (lower is better)",
            "measured": ratios["median"],
            "bound": 1.0,
            "met": ratios["median"] < 1.0,
            "runs": len(restart_ratios(results)),
            "spread": ratios,
        },
    ]


def _stall_bound(results: dict[str, Any]) -> float:
    config = next(iter(_runs(results, "faulted").values()))["config"]
    return float(config["heartbeat"] + config["join"])


def _goodput_text(run: dict[str, Any], base: dict[str, Any] | None) -> str:
    """A faulted run's goodput against its repeat's fault-free ``base`` (empty without one), for the tables."""
    if base is None:
        return ""
    good = run["committed_tokens_per_s"] / (base["committed_tokens_per_s"] * run["alive_fraction"])
    return f"{good:.3f}" + (" (fault-free run lost groups: not counted)" if disturbed(base) else "")


def _share_text(run: dict[str, Any]) -> str:
    """Committed over trained tokens, for the tables (empty if nothing was trained)."""
    return f"{run['committed_tokens'] / run['trained_tokens']:.3f}" if run.get("trained_tokens") else ""


def table(results: dict[str, Any]) -> str:
    """Per repeat: tokens/s without and with faults, groups alive, goodput; stalls by fault kind; time to N steps."""
    free, faulted = _runs(results, "faultfree"), _runs(results, "faulted")
    elastic, single = _runs(results, "elastic_restart"), _runs(results, "checkpoint_restart")
    lines = [
        "| repeat | fault-free tokens/s | faulted tokens/s | groups alive | goodput | committed / trained | syncs lost"
        " | time to N: elastic | time to N: one job, restarted from a checkpoint |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for repeat in sorted(faulted):
        f, ff = faulted[repeat], free.get(repeat)
        good_text, share = _goodput_text(f, ff), _share_text(f)
        lost = sum(s["lost"] for s in f["syncs"])
        e, s = elastic.get(repeat), single.get(repeat)
        lines.append(
            f"| {repeat} | {ff['committed_tokens_per_s']:,.0f} | {f['committed_tokens_per_s']:,.0f} |"
            f" {f['alive_fraction']:.2f} | {good_text} | {share} | {lost} | {e['finished_seconds']:.0f} s |"
            f" {s['wall_seconds']:.0f} s (resumed from {s['resumed_from']}) |"
            if ff and e and s
            else f"| {repeat} | | {f['committed_tokens_per_s']:,.0f} | {f['alive_fraction']:.2f} | | {share} |"
            f" {lost} | | |"
        )
    start_up, join = _spread(replacements(results, "start_up_seconds")), _spread(replacements(results, "join_seconds"))
    if not math.isnan(start_up["median"]):
        lines += [
            "",
            f"A job that replaced a group took {start_up['median']:.1f} s (median; {start_up['min']:.1f}-"
            f"{start_up['max']:.1f} s) from its launch to asking to join, and then {join['median']:.1f} s"
            f" ({join['min']:.1f}-{join['max']:.1f} s) to join: waiting for the others' next sync and healing.",
        ]
    lines += ["", "| fault | faults | survivors' stall, median | min | max |", "|---|---|---|---|---|"]
    for kind in ("kill", "stop", "restart"):
        values = stalls(results, kind)
        spread = _spread(values)
        lines.append(
            f"| {kind} | {len(values)} | {spread['median']:.2f} s | {spread['min']:.2f} s | {spread['max']:.2f} s |"
        )
    return "\n".join(lines)


def standby_table(results: dict[str, Any]) -> str:
    """Per repeat of the standby runs: tokens/s without faults and with them, groups alive, goodput, takeovers."""
    free, runs = _runs(results, "faultfree"), _runs(results, "standby")
    lines = [
        "| repeat | fault-free tokens/s | with faults and standbys, tokens/s | groups alive | goodput |"
        " committed / trained | syncs lost | standby takeovers (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for repeat in sorted(runs):
        run, base = runs[repeat], free.get(repeat)
        good_text, share = _goodput_text(run, base), _share_text(run)
        times = sorted(
            (j["takeover_seconds"], j.get("ready_at_fault") is False)
            for g in run["groups"]
            for j in g["jobs"]
            if j.get("takeover_seconds") is not None
        )
        lines.append(f"| {repeat} | {base['committed_tokens_per_s']:,.0f} |" if base else f"| {repeat} | |")
        lines[-1] += (
            f" {run['committed_tokens_per_s']:,.0f} | {run['alive_fraction']:.2f} | {good_text} | {share} |"
            f" {sum(s['lost'] for s in run['syncs'])} | {', '.join(f'{t:.1f}' + '*' * late for t, late in times)} |"
        )
    hangs = _spread(stalls(results, "stop", "standby"))
    lines += [
        "",
        "Takeovers marked * began before their standby had finished starting (no spare was waiting).",
        "",
        f"One round (the fault-free runs' median time between syncs): {round_seconds(results):.1f} s. A hung group cost"
        f" the others {hangs['median']:.2f} s at their next sync (median; {hangs['min']:.2f}-{hangs['max']:.2f} s).",
    ]
    return "\n".join(lines)


def plot(results: dict[str, Any], images: Path) -> list[Path]:
    """Committed tokens over wall time, fault-free and faulted (repeat 0), with the faults marked."""
    free, faulted = _runs(results, "faultfree"), _runs(results, "faulted")
    if 0 not in free or 0 not in faulted:
        return []
    fig, ax = plotting.figure()
    for label, run, style in (("fault-free", free[0], "-"), ("faulted", faulted[0], "-")):
        start = min(s["t"] for s in run["syncs"])
        tokens_per_group_step = run["config"]["ranks_per_group"] * BATCH * SEQ_LEN
        xs, ys, total = [0.0], [0.0], 0
        for sync in run["syncs"]:
            total += committed_group_steps(sync)
            xs.append(sync["t"] - start)
            ys.append(total * tokens_per_group_step / 1e6)
        ax.plot(xs, ys, style, label=label)
        if label == "faulted":
            colors = {"kill": "red", "stop": "orange", "restart": "green"}
            for fault in run["faults"]:
                ax.axvline(fault["t"] - start, color=colors[fault["kind"]], alpha=0.4, linewidth=1)
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("committed tokens (M)")
    ax.legend()
    return [plotting.save(fig, ax, "Elastic federation: kills (red), hangs (orange), restarts (green)",
                          images / "elastic_goodput.png")]  # fmt: skip


STRANGER_TARGET_IDS = ("stranger-refused",)
TWO_LOST_TARGET_IDS = ("two-groups-lost",)
HANG_TARGET_IDS = ("hang-in-sum-s",)
HEAL_SOURCE_TARGET_IDS = ("heal-source-killed",)
MIXED_TARGET_IDS = ("elastic-goodput-mixed",)
#: What a stranger's job prints when the federation's groups refuse it for want of their secret.
STRANGER_REFUSAL = "does not hold the federation's secret"


def stranger_attempts(run: dict[str, Any]) -> list[dict[str, Any]]:
    """Every stranger of a ``strangers`` run, each with whether it was refused (and received nothing)."""
    attempts = [
        {"kind": f["kind"], "refused": f.get("status") == 403, "status": f.get("status")}
        for f in run["faults"]
        if f["kind"] == "fetch"
    ]
    for s in run.get("strangers", []):
        refused = s["exit_code"] != 0 and STRANGER_REFUSAL in (s["refused"] or "") and s["trained_steps"] == 0
        attempts.append({"kind": s["kind"], "refused": refused, "exit_code": s["exit_code"]})
    return attempts


def stranger_targets(results: dict[str, Any] | None) -> list[Row]:
    """``stranger-refused``: every stranger refused in every run, and the federation's weights as without them."""
    command = "python -m benchmarks.elastic --kinds faultfree,strangers --steps 96"
    if results is None:
        return [_not_run("stranger-refused", command)]
    free, strange = _runs(results, "faultfree"), _runs(results, "strangers")
    repeats = []
    for repeat, run in sorted(strange.items()):
        attempts = stranger_attempts(run)
        baseline = free.get(repeat)
        same = baseline is not None and set(run["checksums"].values()) == set(baseline["checksums"].values())
        lost = sum(bool(s.get("lost")) for s in run["syncs"])
        repeats.append({"repeat": repeat, "refused": sum(a["refused"] for a in attempts), "attempts": len(attempts),
                        "weights_as_without_strangers": same, "syncs_lost": lost, "detail": attempts})  # fmt: skip
    refused = sum(r["refused"] for r in repeats)
    attempts = sum(r["attempts"] for r in repeats)
    met = bool(repeats) and refused == attempts and all(r["weights_as_without_strangers"] for r in repeats)
    return [
        {
            "id": "stranger-refused",
            "target": "strangers on the same machine as a federation with a secret (a plain fetch from a heal server,"
            " a job without the secret, one with another): the share refused, every run; the federation's final"
            " weights equal the fault-free run's of the same repeat (checksum), 4 groups x 2 ranks, 50 Mbit/s",
            "measured": refused / attempts if attempts else None,
            "bound": 1.0,
            "met": met,
            "runs": len(repeats),
            "repeats": repeats,
        }
    ]


def two_lost_targets(results: dict[str, Any] | None) -> list[Row]:
    """``two-groups-lost``: the survivors' stall when two groups die within one round, and the standbys' takeover."""
    command = "python -m benchmarks.elastic --kinds faultfree,twolost --steps 64 --node-cores 0.33"
    if results is None:
        return [_not_run("two-groups-lost", command)]
    runs = _runs(results, "twolost")
    worst = [max(f["stall_seconds"] for f in run["faults"] if f["stall_seconds"] is not None) for run in runs.values()
             if any(f["stall_seconds"] is not None for f in run["faults"])]  # fmt: skip
    placed = [sum(bool(job.get("standby") and job.get("trained_at")) for g in run["groups"] for job in g["jobs"])
              for run in runs.values()]  # fmt: skip
    lost = [sum(bool(s.get("lost")) for s in run["syncs"]) for run in runs.values()]
    spread = _spread(worst)
    config = next(iter(runs.values()))["config"] if runs else {"heartbeat": math.nan, "join": math.nan}
    bound = float(config["heartbeat"] + config["join"])
    return [
        {
            "id": "two-groups-lost",
            "target": "two groups killed within one round: the survivors' stall at their next sync (median of each"
            " run's largest; bound on the largest: the heartbeat timeout plus one quorum's join timeout), with both"
            " places taken by standbys, 4 groups x 2 ranks, 50 Mbit/s",
            "measured": spread["median"],
            "bound": bound,
            "met": bool(worst) and spread["max"] <= bound and all(p == 2 for p in placed),
            "runs": len(worst),
            "spread": spread,
            "standbys_placed": placed,
            "syncs_lost": lost,
        }
    ]


def hang_targets(results: dict[str, Any] | None) -> list[Row]:
    """``hang-in-sum-s``: the survivors' stall when a group hangs inside a sum, against waiting for the timeout."""
    command = "python -m benchmarks.elastic --kinds hanginsum,hanginsum_wait --steps 96"
    if results is None:
        return [_not_run("hang-in-sum-s", command)]
    checked, waited = stalls(results, "hang", "hanginsum"), stalls(results, "hang", "hanginsum_wait")
    runs = _runs(results, "hanginsum")
    config = next(iter(runs.values()))["config"] if runs else {"heartbeat": math.nan}
    bound = float(config["heartbeat"]) + 2.0
    spread = _spread(checked)
    hung = [f.get("hung", False) for run in runs.values() for f in run["faults"] if f["kind"] == "hang"]
    return [
        {
            "id": "hang-in-sum-s",
            "target": "a group stopped (SIGSTOP) inside the sum of a sync: the survivors' stall, from the stop to the"
            " last survivor leaving that sync (largest; bound: the lighthouse's heartbeat timeout + 2 s), the sum"
            " given up once the lighthouse counts the group gone, against waiting for the elastic timeout (15 s),"
            " 4 groups x 2 ranks, 50 Mbit/s",
            "measured": spread["max"],
            "bound": bound,
            "met": bool(checked) and all(hung) and spread["max"] <= bound,
            "runs": len(runs),
            "hangs": len(checked),
            "spread": spread,
            "waiting_for_the_timeout": _spread(waited),
            "syncs_lost": [sum(bool(s.get("lost")) for s in run["syncs"]) for run in runs.values()],
            "consensus": [len(set(run["checksums"].values())) == 1 for run in runs.values()],
        }
    ]


def _run_round_seconds(run: dict[str, Any]) -> float:
    """The median seconds between two committed syncs of one run (its rounds)."""
    committed = [s["t"] for s in run["syncs"][1:] if not s["lost"]]
    gaps = [b - a for a, b in zip(committed, committed[1:])]
    return statistics.median(gaps) if gaps else math.nan


def heal_source_targets(results: dict[str, Any] | None) -> list[Row]:
    """``heal-source-killed``: a joiner whose heal source dies in transit, against a plain replacement."""
    command = "python -m benchmarks.elastic --kinds healsource --node-cores 0.33"
    if results is None:
        return [_not_run("heal-source-killed", command)]
    runs = _runs(results, "healsource")
    faults = [f for run in runs.values() for f in run["faults"]]
    cut = [f["joined_seconds"] for f in faults if f["kind"] == "healkill" and f["joined_seconds"] is not None]
    plain = [f["joined_seconds"] for f in faults if f["kind"] == "restart" and f["joined_seconds"] is not None]
    killed = [f.get("source") is not None for f in faults if f["kind"] == "healkill"]
    joined = [f["joined_seconds"] is not None for f in faults if f["kind"] in ("healkill", "restart")]
    consensus = [len(set(run["checksums"].values())) == 1 for run in runs.values()]
    extra = statistics.median(cut) - statistics.median(plain) if cut and plain else math.nan
    config = next(iter(runs.values()))["config"] if runs else {"heartbeat": math.nan}
    rounds = [_run_round_seconds(run) for run in runs.values()]
    bound = float(config["heartbeat"]) + (statistics.median(rounds) if rounds else math.nan)
    return [
        {
            "id": "heal-source-killed",
            "target": "a replacement group whose heal source is killed while it sends the state: the joiner's extra"
            " seconds to its first committed sync over a plain replacement's in the same runs (medians; bound: the"
            " heartbeat timeout + one round, a retry at its next quorum), every source killed, every joiner in,"
            " one consensus at the end, 4 groups x 2 ranks, 50 Mbit/s, every node capped at 0.33 core",
            "measured": extra,
            "bound": bound,
            "met": bool(cut) and all(killed) and all(joined) and all(consensus) and extra <= bound,
            "runs": len(runs),
            "heals_cut": len(killed),
            "joined_seconds": {"source_killed": _spread(cut), "plain": _spread(plain)},
            "sources_killed": sum(killed),
            "consensus": consensus,
            "syncs_lost": [sum(bool(s.get("lost")) for s in run["syncs"]) for run in runs.values()],
        }
    ]


def mixed_targets(results: dict[str, Any] | None) -> list[Row]:
    """``elastic-goodput-mixed``: goodput through every kind of fault at once, one consensus, no split sync."""
    command = "python -m benchmarks.elastic --kinds faultfree,mixed --node-cores 0.33"
    if results is None:
        return [_not_run("elastic-goodput-mixed", command)]
    runs = _runs(results, "mixed")
    values = goodputs(results, "mixed")
    spread = _spread(values)
    consensus = [len(set(run["checksums"].values())) == 1 for run in runs.values()]
    split = [run.get("split_syncs", []) for run in runs.values()]
    # A hang scheduled for a group whose place a standby took by then does not happen (a standby hangs nowhere).
    faults = [sum(f["kind"] != "hang" or bool(f.get("hung")) for f in run["faults"]) for run in runs.values()]
    return [
        {
            "id": "elastic-goodput-mixed",
            "target": "goodput (as elastic-goodput) through >= 12 faults of every kind with standby groups: kills,"
            " hangs inside a sum, a heal whose source is killed in transit, two groups killed at once, a lighthouse"
            " restart (median); every run ends on one consensus with no sync applied by some groups and lost by"
            " others, 4 groups x 2 ranks, 50 Mbit/s",
            "measured": spread["median"],
            "bound": GOODPUT_BOUND,
            "met": bool(values)
            and spread["median"] >= GOODPUT_BOUND
            and all(consensus)
            and not any(split)
            and min(faults) >= 12,
            "runs": len(values),
            "spread": spread,
            "faults_applied_per_run": faults,
            "consensus": consensus,
            "split_syncs": split,
            "syncs_lost": [sum(bool(s.get("lost")) for s in run["syncs"]) for run in runs.values()],
            "committed_share_of_trained": _spread(committed_shares(results, "mixed")),
            "repeats_without_a_fault_free_baseline": disturbed_repeats(results),
        }
    ]
