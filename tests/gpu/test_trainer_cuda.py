"""The Trainer strategies on a GPU: one process (one group), and two processes sharing the GPU over gloo.

One GPU cannot host two NCCL ranks, so the two-process run uses ``process_group_backend="gloo"`` with CUDA tensors:
FSDP's in-group collectives and the fed ring then go through gloo's CUDA support (host staging). What it covers: the
strategies' device placement, the anchor in host memory beside device shards, and a real two-group sync; what it does
not: NCCL's collectives and streams, which need one GPU per rank.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

import lightning_fedshard
from tests.launch import launch
from tests.toy import IndexedRegression, loss_fn, make_net

WORKER = Path(__file__).with_name("trainer_worker.py")


class Toy(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = make_net()

    def training_step(self, batch, batch_idx):
        _, x, y = batch
        return loss_fn(self.net, x, y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01)


def _fit(accelerator: str, cls: type) -> torch.Tensor:
    torch.manual_seed(0)
    model = Toy()
    trainer = L.Trainer(
        accelerator=accelerator, devices=1, strategy=cls(sync_every=2, outer_optimizer="nesterov"), max_steps=6,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model, DataLoader(IndexedRegression(), batch_size=4))
    assert trainer.strategy.federation.outer.num_syncs == 3
    state = trainer.strategy.lightning_module_state_dict()
    return torch.cat([v.detach().float().cpu().reshape(-1) for v in state.values()])


@pytest.mark.parametrize("cls", [lightning_fedshard.FLFSDPStrategy, lightning_fedshard.FLHSDPStrategy])
def test_one_process_on_the_gpu_trains_like_on_the_cpu(cls):
    gpu, cpu = _fit("gpu", cls), _fit("cpu", cls)
    assert torch.isfinite(gpu).all()
    torch.testing.assert_close(gpu, cpu, rtol=1e-4, atol=1e-5)  # cuBLAS and the CPU round matmuls differently


@pytest.mark.slow
def test_two_processes_share_the_gpu_over_gloo(tmp_path):
    launch(WORKER, [str(tmp_path)], num_nodes=2, devices=1, log_dir=tmp_path / "logs", timeout=300)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(r["num_syncs"] == 3 and r["device"] == "cuda" for r in ranks)
    assert ranks[0]["weights"] == ranks[1]["weights"]  # after the last sync both groups hold the consensus


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
