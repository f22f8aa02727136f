"""One rank of the two-process GPU test: FL+FSDP with two one-rank groups on one GPU, over gloo."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader

import lightning_fedshard
from tests.gpu.test_trainer_cuda import Toy
from tests.toy import IndexedRegression

if __name__ == "__main__":
    torch.manual_seed(int(os.environ["RANK"]))
    strategy = lightning_fedshard.FLFSDPStrategy(sync_every=2, outer_optimizer="nesterov", process_group_backend="gloo")
    trainer = L.Trainer(
        accelerator="gpu", devices=1, num_nodes=2, strategy=strategy, max_steps=6, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    model = Toy()
    trainer.fit(model, DataLoader(IndexedRegression(), batch_size=4))
    shards = [s.detach().cpu().reshape(-1) for s in trainer.strategy.local_shards()]
    out = {
        "num_syncs": trainer.strategy.federation.outer.num_syncs,
        "device": shards and trainer.strategy.local_shards()[0].device.type,
        "weights": torch.cat(shards).tolist(),
    }
    Path(sys.argv[1], f"rank{os.environ['RANK']}.json").write_text(json.dumps(out))
