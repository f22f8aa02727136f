"""One rank of the meta-init test: LlamaLM(meta_init=True) under the Trainer and FL+FSDP, with a byte counter.

Every module's ``reset_parameters`` (called by FSDP as it materializes a unit) is wrapped to record how many bytes of
parameters the model holds outside FSDP's flat shards right after each call. The rank then compares its full weights
with a single-process materialization and trains two steps.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

import lightning_fedshard
from lightning_fedshard.examples import LlamaLM
from lightning_fedshard.examples.meta_init import materialized_bytes

STRATEGIES = {"fsdp1": lightning_fedshard.FLFSDPStrategy, "fsdp2": lightning_fedshard.FLFSDP2Strategy}


class CountingLlamaLM(LlamaLM):
    """Records ``materialized_bytes`` after every ``reset_parameters`` call FSDP makes."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.trace: list[tuple[int, int]] = []

    def configure_model(self) -> None:
        super().configure_model()
        for module in self.model.modules():
            if "reset_parameters" in vars(module):
                module.reset_parameters = _Counted(module.reset_parameters, self)


class _Counted:
    def __init__(self, reset: Any, root: CountingLlamaLM) -> None:
        self.reset, self.root = reset, root

    def __call__(self) -> None:
        self.reset()
        self.root.trace.append(materialized_bytes(self.root))


class Tokens(Dataset):
    def __init__(self, vocab: int, seq_len: int, n: int = 64) -> None:
        g = torch.Generator().manual_seed(0)
        self.data = torch.randint(0, vocab, (n, seq_len + 1), generator=g)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.data[i, :-1], "labels": self.data[i, 1:]}


class Recorder(L.Callback):
    def __init__(self) -> None:
        self.initial: dict[str, torch.Tensor] = {}
        self.inv_freq = torch.empty(0)
        self.shard_bytes = 0
        self.losses: list[float] = []

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.initial = {k: v.clone() for k, v in trainer.strategy.lightning_module_state_dict().items()}
        self.inv_freq = pl_module.model.model.rotary_emb.inv_freq.clone()
        self.shard_bytes = sum(s.numel() * s.element_size() for s in trainer.strategy.local_shards())

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, *args: Any) -> None:
        self.losses.append(float(outputs["loss"]))


def main(config: dict[str, Any], out: Path, backend: str) -> None:
    rank = int(os.environ["RANK"])
    torch.manual_seed(1000 + rank)  # the global RNG differs per rank: initialization must not depend on it
    model = CountingLlamaLM(**config, meta_init=True)
    recorder = Recorder()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ["DEVICES"]),
        num_nodes=int(os.environ["NUM_NODES"]),
        strategy=STRATEGIES[backend](num_groups=2, sync_every=2, auto_wrap_policy=LlamaLM.wrap_policy()),
        max_steps=2,
        callbacks=[recorder],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(model, DataLoader(Tokens(config["vocab_size"], config["max_seq_len"]), batch_size=2))
    torch.save(
        {
            "trace": model.trace,
            "initial": recorder.initial,
            "inv_freq": recorder.inv_freq,
            "shard_bytes": recorder.shard_bytes,
            "losses": recorder.losses,
        },
        out / f"rank{rank}.pt",
    )


if __name__ == "__main__":
    main(json.loads(sys.argv[1]), Path(sys.argv[2]), sys.argv[3])
