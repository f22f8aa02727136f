"""Pre-train a small Llama on Shakespeare with FL+HSDP (or any strategy of the config), on CPU or GPUs.

    OMP_NUM_THREADS=1 python examples/train_shakespeare.py --config configs/shakespeare/fl_hsdp.yaml

The same YAML works with ``fedshard fit --config ...``; this script adds what a first run should show: the
validation perplexity of the initial model, Lightning's training run (progress bar, CSV logs), the perplexity of
the consensus model after training, and the consensus exported with ``save_pretrained``.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from lightning_fedshard.cli import cli
from lightning_fedshard.examples import LlamaLM, ShakespeareDataModule


def is_launching_process() -> bool:
    """True in the process the user started (Lightning re-executes this script for the other local ranks)."""
    return os.environ.get("LOCAL_RANK", "0") == "0" and os.environ.get("NODE_RANK", "0") == "0"


@torch.no_grad()
def evaluate(model: LlamaLM, loader: DataLoader, max_batches: int, bytes_per_token: float) -> dict[str, float]:
    """Token-weighted validation loss of an unwrapped model, as perplexity and bits per byte."""
    model.eval()
    total_nll, total_tokens = 0.0, 0
    for i, batch in enumerate(loader):
        if i == max_batches:
            break
        tokens = batch["labels"].numel()
        total_nll += model._nll(batch).item() * tokens
        total_tokens += tokens
    nll = total_nll / total_tokens
    return {"ppl": math.exp(nll), "bpb": nll / math.log(2) / bytes_per_token}


def main() -> None:
    started = time.perf_counter()
    run = cli(run=False)
    trainer, model, data = run.trainer, run.model, run.datamodule
    assert isinstance(model, LlamaLM) and isinstance(data, ShakespeareDataModule)
    max_val_batches = int(trainer.limit_val_batches) if isinstance(trainer.limit_val_batches, int) else 10**9

    before = None
    if is_launching_process():  # other ranks do not exist yet: they start inside trainer.fit
        data.prepare_data()
        data.setup("validate")
        before = evaluate(model, data.val_dataloader(), max_val_batches, data.val_bytes_per_token)
        strategy = trainer.strategy
        print(
            f"\nTopology: {getattr(strategy, 'topology', type(strategy).__name__)};"
            f" model: {model.num_parameters() / 1e6:.2f} M parameters"
        )
        print(f"Validation before training: perplexity {before['ppl']:.1f}, {before['bpb']:.3f} bits/byte\n")
        model.train()

    trainer.fit(model, datamodule=data)

    # Collective: every rank takes part in gathering the consensus model; global rank 0 receives it.
    state_dict = trainer.strategy.lightning_module_state_dict()
    if trainer.global_rank != 0:
        return
    out = Path(trainer.default_root_dir)
    consensus = LlamaLM(**{k: v for k, v in model.hparams.items() if not k.startswith("_")})
    consensus.load_state_dict(state_dict)
    after = evaluate(consensus, data.val_dataloader(), max_val_batches, data.val_bytes_per_token)
    consensus.save_pretrained(out / "consensus")
    logs = trainer.logger.log_dir if trainer.logger is not None else "(no logger)"
    print(
        f"\nValidation perplexity: {before['ppl']:.1f} before -> {after['ppl']:.1f} after training"
        f" ({before['bpb']:.3f} -> {after['bpb']:.3f} bits/byte) in {trainer.global_step} steps,"
        f" {time.perf_counter() - started:.0f} s wall time.\n"
        f"Logs: {logs}\nConsensus model (save_pretrained): {out / 'consensus'}"
    )


if __name__ == "__main__":
    main()
