"""One rank of the workflow test: Lightning's demo model through fit -> test -> validate -> predict -> fit.

Each registered strategy name runs with the Trainer's defaults (sanity check on, a validation loop, the default
logger and progress bar); what each rank saw is saved for the test to compare across ranks and groups.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_fedshard import FLFSDPStrategy, Gossip, Hierarchical, Sampled  # importing registers the strategy names

NAMES = ("fl_fsdp", "fl_hsdp", "fl_fsdp2", "fl_hsdp2")
#: The same workflow with sync options whose groups hold sums in flight or differ between syncs (sync_every=2).
VARIANTS = {
    "eager": lambda: FLFSDPStrategy(sync_every=2, eager_updates="local"),
    "hierarchical": lambda: FLFSDPStrategy(num_groups=4, sync_every=2, outer_topology=Hierarchical({2: 2, 4: 4})),
    "gossip": lambda: FLFSDPStrategy(num_groups=4, sync_every=2, outer_topology=Gossip(peers=1)),  # reduce_dtype unset
    # the mixes travel a step while training goes on, int4-encoded against the anchor
    "gossip_int4_delayed": lambda: FLFSDPStrategy(
        num_groups=4, sync_every=2, outer_topology=Gossip(peers=1), reduce_dtype="int4", sync_delay=1
    ),
    "sampled": lambda: FLFSDPStrategy(
        num_groups=4, sync_every=2, reduce_dtype="float32", outer_topology=Sampled(2, outer_step=True)
    ),
}


class Demo(BoringModel):
    """Lightning's BoringModel, recording what it computed in each loop."""

    def __init__(self) -> None:
        super().__init__()
        self.sanity_batches = 0
        self.test_losses: list[float] = []

    def validation_step(self, batch, batch_idx):
        if self.trainer.sanity_checking:
            self.sanity_batches += 1
        out = super().validation_step(batch, batch_idx)
        self.log("val_loss", out["x"], sync_dist=True)
        return out

    def test_step(self, batch, batch_idx):
        out = super().test_step(batch, batch_idx)
        self.test_losses.append(float(out["y"]))
        return out


class LastStep(L.Callback):
    """This rank's weights after each optimizer step and its sync (``OuterSync`` runs first), before ``fit`` ends."""

    def __init__(self) -> None:
        self.weights: torch.Tensor | None = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.weights = _weights(trainer)


def _trainer(name: Any, root: Path, max_steps: int, last_step: LastStep) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=int(os.environ["DEVICES"]),
        num_nodes=int(os.environ["NUM_NODES"]),
        strategy=name,
        max_steps=max_steps,
        default_root_dir=root,
        callbacks=[last_step],
    )


def _weights(trainer: L.Trainer) -> torch.Tensor:
    return torch.cat([s.detach().reshape(-1).clone() for s in trainer.strategy.local_shards()])


def run(name: str, root: Path, strategy: Any = None) -> dict[str, Any]:
    torch.manual_seed(int(os.environ["RANK"]))  # different initial weights: the strategy must make them equal
    model = Demo()
    last_step = LastStep()
    trainer = _trainer(strategy or name, root / name, max_steps=4, last_step=last_step)
    trainer.fit(model)
    seen: dict[str, Any] = {"sanity_batches": model.sanity_batches, "after_fit": _weights(trainer)}
    seen["before_end_of_fit"] = last_step.weights
    federation = trainer.strategy.federation
    seen["syncs_after_fit"] = federation.outer.num_syncs
    trainer.test(model)
    seen["test_losses"] = list(model.test_losses)
    seen["after_test"] = _weights(trainer)
    checkpoint = trainer.checkpoint_callback.best_model_path
    seen["checkpoint"] = checkpoint
    seen["validate"] = {k: float(v) for k, v in trainer.validate(model, ckpt_path=checkpoint)[0].items()}
    seen["predictions"] = len(trainer.predict(model))
    trainer.fit_loop.epoch_loop.max_steps = 8
    trainer.fit(model)
    seen["same_federation"] = trainer.strategy.federation is federation
    seen["syncs_after_second_fit"] = trainer.strategy.federation.outer.num_syncs
    seen["global_step"] = trainer.global_step
    seen["after_second_fit"] = _weights(trainer)
    seen["callbacks"] = [type(c).__name__ for c in trainer.callbacks]
    seen["final_checkpoint"] = trainer.checkpoint_callback.best_model_path
    return seen


def resume_under_ddp(checkpoint: str, root: Path) -> dict[str, Any]:
    """A plain strategy resumes the consensus, the loops and the schedulers of a federated checkpoint."""
    loaded: dict[str, torch.Tensor] = {}

    class Probe(L.Callback):
        def on_train_start(self, trainer, pl_module):
            loaded.update({k: v.detach().clone() for k, v in pl_module.state_dict().items()})

    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ["DEVICES"]),
        num_nodes=int(os.environ["NUM_NODES"]),
        strategy="ddp",
        max_steps=10,
        default_root_dir=root / "ddp",
        callbacks=[Probe()],
    )
    trainer.fit(Demo(), ckpt_path=checkpoint)
    return {"loaded": loaded, "global_step": trainer.global_step}


if __name__ == "__main__":
    root = Path(sys.argv[1])
    results = {name: run(name, root) for name in NAMES}
    results |= {name: run(name, root, make()) for name, make in VARIANTS.items()}
    results["ddp"] = resume_under_ddp(results["fl_fsdp"]["final_checkpoint"], root)
    torch.save(results, root / f"rank{os.environ['RANK']}.pt")
