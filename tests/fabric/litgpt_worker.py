"""One rank of the litgpt test: litgpt's own pretraining loop, unmodified, on the Fabric FL+FSDP strategy.

``litgpt.pretrain.main`` is what ``litgpt pretrain`` runs after building its Fabric; here the Fabric is built on
``lightning_fedshard.fabric.FLFSDPStrategy`` (litgpt's ``state_dict_type="full"``) and handed to it. The first call
trains and saves every ``save_interval`` steps; a second call with ``resume="auto"`` continues from the last of those
checkpoints. Rank 0 then records the consensus the strategy holds, evaluated on a fixed batch, for the test to compare
with ``final/lit_model.pth`` as litgpt's tools read it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from litgpt import Config
from litgpt.args import EvalArgs, TrainArgs
from litgpt.data import DataModule
from litgpt.model import GPT
from litgpt.pretrain import main as pretrain
from torch.utils.data import DataLoader, TensorDataset

import lightning_fedshard.fabric

CONFIG = dict(name="tiny", block_size=16, vocab_size=64, padded_vocab_size=64, n_layer=2, n_head=2, n_embd=16)
SEQ, MICRO_BATCH = 16, 2


class RandomTokens(DataModule):
    """Token windows with a pattern to learn (each token is the previous one plus one, modulo the vocabulary)."""

    def connect(self, tokenizer: Any = None, batch_size: int = 1, max_seq_length: int = -1) -> None:
        self.batch_size = batch_size

    def _windows(self, n: int, seed: int) -> TensorDataset:
        start = torch.randint(0, CONFIG["vocab_size"], (n, 1), generator=torch.Generator().manual_seed(seed))
        return (start + torch.arange(SEQ + 1)) % CONFIG["vocab_size"]

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self._windows(256, 0), batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self._windows(32, 1), batch_size=self.batch_size)


def fixed_batch() -> torch.Tensor:
    return RandomTokens()._windows(8, 2)


def evaluate(model: torch.nn.Module) -> float:
    """litgpt's loss of ``model`` on a fixed batch."""
    from litgpt.utils import chunked_cross_entropy

    batch = fixed_batch()
    with torch.no_grad():
        return float(chunked_cross_entropy(model(batch[:, :SEQ]), batch[:, 1:]))


def run(out_dir: Path, max_tokens: int, resume: bool | str) -> L.Fabric:
    strategy = lightning_fedshard.fabric.FLFSDPStrategy(sync_every=2, state_dict_type="full", reduce_dtype="float32")
    fabric = L.Fabric(
        accelerator="cpu", devices=int(os.environ["DEVICES"]), num_nodes=int(os.environ["NUM_NODES"]), strategy=strategy
    )
    fabric.launch()
    sys.argv = [sys.argv[0], "pythia-14m"]  # what litgpt's `save_hyperparameters` parses
    pretrain(
        fabric=fabric,
        devices=int(os.environ["DEVICES"]),
        num_nodes=int(os.environ["NUM_NODES"]),
        seed=42,
        initial_checkpoint_dir=None,
        resume=resume,
        config=Config(**CONFIG),
        data=RandomTokens(),
        out_dir=out_dir,
        tokenizer_dir=None,
        tokenizer=None,
        train=TrainArgs(
            save_interval=4,
            log_interval=1,
            global_batch_size=MICRO_BATCH * fabric.world_size,
            micro_batch_size=MICRO_BATCH,
            max_tokens=max_tokens,
            max_seq_length=SEQ,
            lr_warmup_steps=2,
            max_norm=1.0,
        ),  # fmt: skip
        eval=EvalArgs(interval=1000, max_iters=2, final_validation=False),
        optimizer={"class_path": "torch.optim.AdamW", "init_args": {"lr": 0.01}},
    )
    return fabric


if __name__ == "__main__":
    out = Path(sys.argv[1])
    tokens_per_step = MICRO_BATCH * SEQ * int(os.environ["WORLD_SIZE"])
    run(out, 6 * tokens_per_step, resume=False)  # 6 steps, saves at step 4
    fabric = run(out, 10 * tokens_per_step, resume="auto")  # resumes at step 4, saves at 8, ends at 10
    consensus = fabric.strategy.runtime.checkpointer.consensus_state_dict("full")
    if fabric.global_rank == 0:
        model = GPT(Config(**CONFIG))
        model.load_state_dict(consensus)
        torch.save({"loss": evaluate(model), "num_steps": fabric.strategy.num_steps}, out / "consensus.pt")
