"""One rank of one elastic group job: trains the toy model with the Trainer (or Fabric) and records every sync.

Run as a script per rank, with the group's rendezvous in the environment (see ``tests/elastic/cluster.py``). The
spec (JSON, argv[1]) chooses the strategy and the faults this job injects into itself at a chosen step:
``kill`` (SIGKILL mid-round, before the step's batch), ``kill_in_sum`` (SIGKILL inside the sum over the groups of
the sync after that step), ``stop`` (SIGSTOP, mid-round) - on the rank ``fault_rank`` (default 0).

What each rank saw goes to ``<out>/group<g>_<n>/rank<r>.pt``: every sync's statistics, the consensus state dict at
every committed sync (a collective inside the group), the learning rate and the batch indices of every step, the
final consensus, and the error that ended the job, if any.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

import lightning_fedshard
from lightning_fedshard.elastic import ElasticCommunicator
from tests.toy import IndexedRegression, loss_fn, make_net

STRATEGIES = {
    "fl_fsdp": lightning_fedshard.FLFSDPStrategy,
    "fl_hsdp": lightning_fedshard.FLHSDPStrategy,
    "fl_fsdp2": lightning_fedshard.FLFSDP2Strategy,
    "fl_hsdp2": lightning_fedshard.FLHSDP2Strategy,
}

RANK = int(os.environ.get("RANK", "0"))


def _fault(spec: dict[str, Any], kind: str) -> int | None:
    fault = spec.get("fault") or {}
    if fault.get("kind") == kind and RANK == fault.get("rank", 0):
        return int(fault["step"])
    return None


def _install_heal_fault(spec: dict[str, Any]) -> None:
    """Every transfer of a peer's state to this job fails."""
    if (spec.get("fault") or {}).get("kind") != "fail_heals":
        return
    from lightning_fedshard.elastic import heal

    def failing(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("injected: the transfer of a peer's state failed")

    heal.fetch_state = failing  # what every heal transport's `recv_checkpoint` calls


def _install_sum_fault(spec: dict[str, Any], runtime_step: Any) -> None:
    """Die inside the first sum over the groups of the sync after step ``kill_in_sum``."""
    step = _fault(spec, "kill_in_sum")
    if step is None:
        return
    for name in ("sum_over_groups", "all_to_all"):
        original = getattr(ElasticCommunicator, name)

        def dying(self: ElasticCommunicator, *args: Any, _original: Any = original) -> None:
            if runtime_step() == step:
                os.kill(os.getpid(), signal.SIGKILL)
            _original(self, *args)

        setattr(ElasticCommunicator, name, dying)


class Module(L.LightningModule):
    def __init__(self, spec: dict[str, Any]) -> None:
        super().__init__()
        self.spec = spec
        torch.manual_seed(spec.get("init_seed", 0))
        self.net = make_net(spec.get("hidden"))
        self.batches: dict[int, list[int]] = {}
        self.lrs: dict[int, float] = {}

    def training_step(self, batch, batch_idx):
        idx, x, y = batch
        self.batches[self.trainer.global_step] = idx.tolist()
        self.lrs[self.trainer.global_step] = self.trainer.optimizers[0].param_groups[0]["lr"]
        return loss_fn(self.net, x, y)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.spec.get("lr", 0.05))
        total = self.spec["max_steps"]
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * s / total)))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class Recorder(L.Callback):
    """Records each sync right after it (``OuterSync`` runs first), and injects this job's faults."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.syncs: list[dict[str, Any]] = []
        self.consensus: dict[int, dict[str, torch.Tensor]] = {}
        self.initial: dict[str, torch.Tensor] | None = None
        self.joined_at: int | None = None
        self.trained_at: float | None = None
        self.started: dict[int, dict[str, Any]] = {}
        self._seen: Any = None

    def on_train_start(self, trainer, pl_module):
        if trainer.strategy.runtime.standing_by:  # a standby whose federation ended: nothing to record
            return
        import time

        self.joined_at, self.trained_at = trainer.global_step, time.time()
        self.initial = _consensus(trainer)
        self._record(trainer)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        step = trainer.global_step
        if _fault(self.spec, "kill") == step:
            os.kill(os.getpid(), signal.SIGKILL)
        if _fault(self.spec, "stop") == step:
            os.kill(os.getpid(), signal.SIGSTOP)
        if self.spec.get("step_sleep"):
            import time

            time.sleep(self.spec["step_sleep"])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._record(trainer)

    def on_train_end(self, trainer, pl_module):
        if not trainer.strategy.runtime.standing_by:
            self._record(trainer)

    def _record(self, trainer) -> None:
        for pending in getattr(trainer.strategy.runtime.federation.round, "sums", {}).values():
            if pending.started_at == trainer.global_step:  # eager updates: the sum that started at this sync
                self.started[trainer.global_step] = {"members": list(pending.participants),
                                                     "joined": list(pending.joined)}  # fmt: skip
        stats = trainer.strategy.runtime.last_sync_stats
        if stats is None or stats is self._seen:
            return
        self._seen = stats
        step = trainer.global_step
        self.syncs.append(
            {
                "step": step,
                "groups": stats.extra.get("groups", 0),
                "members": list(trainer.strategy.runtime.membership.members),
                "joined": list(stats.joined_groups),
                "lost": stats.lost,
                "num_syncs": stats.num_syncs,
                "heal_seconds": stats.extra.get("heal_seconds"),
            }
        )
        if not stats.lost:
            self.consensus[step] = _consensus(trainer)
        if RANK == 0:  # lets a test wait for a group to reach a step
            (Path(self.spec["out"]) / "progress").write_text(str(step))


def _consensus(trainer) -> dict[str, torch.Tensor]:
    state = trainer.strategy.runtime.checkpointer.consensus_state_dict("full")
    return {k: v.detach().clone() for k, v in state.items()}


def _strategy(spec: dict[str, Any], cls: Any = None) -> Any:
    elastic = lightning_fedshard.Elastic(
        federation=spec.get("federation", "tests"),
        timeout=spec.get("timeout", 10.0),
        quorum_timeout=spec.get("quorum_timeout", 60.0),
        connect_timeout=10.0,
        quorum_retries=spec.get("quorum_retries", 3),
        group_timeout=spec.get("group_timeout", 5.0),
        start_groups=spec.get("start_groups"),
        min_groups=spec.get("min_groups", 1),
        standby=spec.get("standby", False),
        secret=spec.get("secret"),
    )
    keys = ("shard_size", "sync_every", "outer_optimizer", "fragments", "sync_delay", "reduce_dtype", "merge_alpha",
            "eager_updates")  # fmt: skip
    kwargs = {k: spec[k] for k in keys if k in spec}
    if spec.get("fragments", 1) > 1:
        kwargs["fsdp_modules" if spec["strategy"].endswith("2") else "auto_wrap_policy"] = {torch.nn.Linear}
    if spec.get("sampled"):  # (groups_per_round, seed) of sampled participation
        groups_per_round, seed = spec["sampled"]
        kwargs["outer_topology"] = lightning_fedshard.Sampled(groups_per_round, seed=seed, outer_step=True)
    if spec.get("gossip"):  # (peers, seed) of a gossip mixing
        peers, seed = spec["gossip"]
        kwargs["outer_topology"] = lightning_fedshard.Gossip(peers, seed=seed)
    if spec.get("pace"):  # the planned groups' speeds
        kwargs["pace"] = lightning_fedshard.Pace(speeds=tuple(spec["pace"]))
    if spec.get("hierarchical"):  # ([[period, groups], ...], sites) of a hierarchical outer topology
        levels, sites = spec["hierarchical"]
        kwargs["outer_topology"] = lightning_fedshard.Hierarchical(dict(levels), sites=sites)
    cls = cls or STRATEGIES[spec["strategy"]]
    return cls(num_groups=spec["num_groups"], elastic=elastic, **kwargs)


def run(spec: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    spec = {**spec, "out": str(out)}
    module = Module(spec)
    recorder = Recorder(spec)
    callbacks: list[L.Callback] = [recorder]
    if spec.get("ckpt_every"):
        callbacks.append(
            ModelCheckpoint(
                dirpath=out / "ckpts", filename="{step}", every_n_train_steps=spec["ckpt_every"], save_top_k=-1
            )  # fmt: skip
        )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ["DEVICES"]),
        num_nodes=1,
        strategy=_strategy(spec),
        max_steps=spec["max_steps"],
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=bool(spec.get("ckpt_every")),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    _install_sum_fault(spec, lambda: trainer.strategy.runtime.step)
    _install_heal_fault(spec)
    data = _loader(spec)
    error = None
    try:
        trainer.fit(module, data, ckpt_path=spec.get("resume"))
    except BaseException as e:  # recorded for the test (Lightning ends a run it got SIGTERM for with one)
        error = f"{type(e).__name__}: {e}"
    runtime = trainer.strategy.runtime
    final = _consensus(trainer) if error is None and not runtime.standing_by else None
    _save(out, error, recorder, module, final, trainer.global_step, runtime.group_index)


def run_fabric(spec: dict[str, Any], out: Path) -> None:
    """The same training in a Fabric loop: the group joins explicitly, with its scheduler and loader."""
    from torch.utils.data import DistributedSampler
    from torchdata.stateful_dataloader import StatefulDataLoader

    import lightning_fedshard.fabric as fabric_strategies

    out.mkdir(parents=True, exist_ok=True)
    spec = {**spec, "out": str(out)}
    strategy = _strategy(spec, getattr(fabric_strategies, STRATEGIES[spec["strategy"]].__name__))
    fabric = L.Fabric(accelerator="cpu", devices=int(os.environ["DEVICES"]), strategy=strategy)
    fabric.launch()
    module = Module(spec)
    model = fabric.setup_module(module.net)
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=spec.get("lr", 0.05)))
    total = spec["max_steps"]
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * s / total)))
    if spec.get("standby") and not strategy.stand_by():  # before the data: a standby's part is its group's
        _save(out, None, Recorder(spec), module, None, 0, strategy.runtime.group_index)
    data = IndexedRegression()
    sampler = DistributedSampler(data, shuffle=True, seed=0, **strategy.distributed_sampler_kwargs)
    loader = StatefulDataLoader(data, batch_size=spec.get("batch_size", 4), sampler=sampler)
    batches = fabric.setup_dataloaders(loader, use_distributed_sampler=False)
    recorder = Recorder(spec)
    shim = _FabricTrainer(strategy)
    error = None
    try:
        step = strategy.join({"loader": loader}, after_step={"scheduler": scheduler})
        recorder.joined_at = shim.global_step = step
        recorder.initial = _consensus(shim)
        recorder._record(shim)
        while step < total:
            for idx, x, y in batches:
                if _fault(spec, "kill") == step:
                    os.kill(os.getpid(), signal.SIGKILL)
                module.batches[step] = idx.tolist()
                module.lrs[step] = optimizer.param_groups[0]["lr"]
                fabric.backward(loss_fn(model, x, y))
                optimizer.step()
                optimizer.zero_grad()
                scheduler.step()
                step += 1
                shim.global_step = step
                recorder._record(shim)
                if step == total:
                    break
        strategy.finish()
        recorder._record(shim)
    except Exception as e:  # recorded for the test
        error = f"{type(e).__name__}: {e}"
    _save(out, error, recorder, module, _consensus(shim) if error is None else None, step, strategy.runtime.group_index)


class _FabricTrainer:
    """What the recorder reads from a Trainer, for a Fabric loop."""

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy
        self.global_step = 0


def _save(
    out: Path, error: str | None, recorder: Recorder, module: Module, final: Any, step: int, group: int | None = None
) -> None:
    result = {
        "error": error,
        "group": int(os.environ["FEDSHARD_GROUP"]) if group is None else group,
        "joined_at": recorder.joined_at,
        "trained_at": recorder.trained_at,
        "initial": recorder.initial,
        "syncs": recorder.syncs,
        "started": recorder.started,
        "consensus": recorder.consensus,
        "batches": module.batches,
        "lrs": module.lrs,
        "final": final,
        "global_step": step,
    }
    torch.save(result, out / f"rank{RANK}.pt")
    sys.stdout.flush()
    os._exit(0 if error is None else 3)  # gloo threads may still hold tensors: leave without finalizing


def _loader(spec: dict[str, Any]) -> DataLoader:
    """A resumable loader, so that a group that joins continues at its step's batch (Lightning adds the sampler)."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    data = IndexedRegression()
    # torch's RandomSampler, which Lightning replaces by a shuffling DistributedSampler over the group's part
    return StatefulDataLoader(data, batch_size=spec.get("batch_size", 4), sampler=torch.utils.data.RandomSampler(data))


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    (run_fabric if spec.get("fabric") else run)(spec, Path(sys.argv[2]))
