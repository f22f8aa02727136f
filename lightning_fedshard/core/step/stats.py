"""What one sync did, as the loggers, the progress bar and the benchmarks see it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SyncStats:
    """What one outer step did, for logging.

    Attributes:
        outer_grad_norm: L2 norm of the averaged pseudo-gradient over the whole model. At a site sync or a mix (no
            outer step) the root mean square, over groups, of the norm of ``anchor - theta_g'``, with ``theta_g'`` the
            weights the sync gave group ``g``: the averaged pseudo-gradient each group holds since the last outer step
            (with ``"fedavg"`` an outer step's norm is the same quantity).
        drift: Root mean square, over groups, of the L2 distance between a group's weights just before the sync and
            the mean weights the sync applies (0 when all groups hold the same weights). With a float all-reduce the
            applied mean is the groups' mean; with int8/int4 it is a quantized estimate of it, and the drift is then
            ``sqrt(exact_drift**2 + |estimate - mean|**2)``: above the exact value by at most the estimate's error. At
            a site sync the applied mean is the group's site mean, at a mix the group's row of the mix. Skipped
            groups are left out of it.
        bytes_sent: Bytes this rank sends in the outer all-reduce, assuming a ring all-reduce
            (``2 (G-1)/G`` times the payload).
        seconds: Wall time of the whole outer step on this rank.
        num_syncs: Number of outer steps done so far, including this one (site syncs and mixes are counted in
            ``site_syncs``).
        skipped_groups: Groups left out of the mean because their pseudo-gradient (at a site sync or a mix: their
            weights) was not finite (``on_nonfinite="skip_group"``); they restart from what the sync applied.
        fragment: The fragment that synced (0 with one fragment).
        exposed_seconds: Seconds the training loop was blocked by this sync (taking the pseudo-gradient, waiting for
            the sum, the outer optimizer step); less than ``seconds`` when the sum overlapped with training.
        compute_utilization: Over the round that this sync closes: compute time / (compute time + exposed sync
            time), where compute time is the round's wall time minus the exposed sync time. Set by the runtime.
        num_fragments: How many fragments the model is cut into (the fragment index is logged when > 1).
        lost: Whether the communicator refused to commit this sync: nothing of it was applied (every group went back
            to the anchor, or, in the plain round, carries its training to the next sync: ``extra["carried"]``).
        syncs_lost: Syncs lost so far, this one included (logged once there is one).
        discarded_fraction: The share of the round's inner-step progress that this landing threw away: with
            ``sync_delay = d`` and ``merge_alpha = a`` a landing replaces the ``d`` steps trained since its snapshot
            by the anchor, keeping only ``a`` of them, so ``(1 - a) d / sync_every`` (0 without a delay and with
            eager updates, which keep everything). Set by the federation.
        effective_utilization: ``compute_utilization * (1 - discarded_fraction)``: the share of the round's time
            spent on compute whose progress survives. Set by the runtime.
        joined_groups: Groups that took the federation's state from a peer at this sync (an elastic federation's
            joining or lagging groups); they added nothing to the mean.
        site_syncs: Syncs done so far, including this one, that averaged or mixed the groups' weights without an
            outer step: a hierarchical topology's site syncs and a mixing topology's mixes.
        kind: ``"outer step"``, ``"site sync"`` (a hierarchical topology's level below the federation) or ``"mix"``.
        extra: What only one sync mode measures, by name (logged as ``fedshard/<name>``): a site sync's
            ``site_size`` (the groups that averaged), a mix's ``mixing_partners`` (the groups this one sent its
            weights to), an elastic sync's ``groups`` (that took part) and ``heal_seconds`` (spent receiving and
            loading a peer's state, when it healed).
    """

    outer_grad_norm: float
    drift: float
    bytes_sent: int
    seconds: float
    num_syncs: int
    skipped_groups: tuple[int, ...] = ()
    fragment: int = 0
    exposed_seconds: float = 0.0
    compute_utilization: float | None = None
    num_fragments: int = 1
    lost: bool = False
    syncs_lost: int = 0
    discarded_fraction: float = 0.0
    effective_utilization: float | None = None
    joined_groups: tuple[int, ...] = ()
    site_syncs: int = 0
    kind: str = "outer step"
    extra: Mapping[str, float] = field(default_factory=dict)

    @property
    def total_syncs(self) -> int:
        """Syncs of every kind done so far: outer steps plus site syncs and mixes (the progress bar's ``syncs``)."""
        return self.num_syncs + self.site_syncs

    def skipped_message(self, step: int) -> str | None:
        """What a user is told when the sync after optimizer step ``step`` left broken groups out; ``None`` if none."""
        if not self.skipped_groups:
            return None
        if self.kind == "outer step":
            what, sync, restart = "a non-finite outer gradient", f"sync {self.num_syncs}", "the new anchor"
        else:
            what, sync, restart = (
                "non-finite weights",
                f"a {self.kind}",
                f"the {self.kind}'s mean of their healthy partners",
            )
        return (
            f"Skipped federation group(s) {list(self.skipped_groups)} with {what} at optimizer step {step} ({sync}):"
            f" the {self.kind} averaged the healthy groups only, and the skipped groups restart from {restart} with a"
            " fresh inner optimizer state."
        )

    def as_dict(self, prefix: str = "fedshard/") -> dict[str, float]:
        """The statistics as a flat ``{name: value}`` dict for loggers."""
        stats = {
            f"{prefix}outer_grad_norm": self.outer_grad_norm,
            f"{prefix}drift": self.drift,
            f"{prefix}sync_bytes": float(self.bytes_sent),
            f"{prefix}sync_seconds": self.seconds,
            f"{prefix}num_syncs": float(self.num_syncs),
        }
        stats[f"{prefix}sync_exposed_seconds"] = self.exposed_seconds
        if self.compute_utilization is not None:
            stats[f"{prefix}compute_utilization"] = self.compute_utilization
        if self.effective_utilization is not None:
            stats[f"{prefix}effective_utilization"] = self.effective_utilization
        if self.num_fragments > 1:
            stats[f"{prefix}fragment"] = float(self.fragment)
        if self.skipped_groups:
            stats[f"{prefix}skipped_groups"] = float(len(self.skipped_groups))
        if self.syncs_lost:
            stats[f"{prefix}syncs_lost"] = float(self.syncs_lost)
        if self.joined_groups:
            stats[f"{prefix}joined_groups"] = float(len(self.joined_groups))
        stats.update({f"{prefix}{name}": float(value) for name, value in self.extra.items()})
        if self.site_syncs:
            stats[f"{prefix}site_syncs"] = float(self.site_syncs)
        return stats
