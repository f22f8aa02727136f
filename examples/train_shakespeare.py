"""Pre-train a small Llama on Shakespeare with FL+HSDP (or any strategy of the config), on CPU or GPUs.

    OMP_NUM_THREADS=1 python examples/train_shakespeare.py --config configs/shakespeare/fl_hsdp.yaml

The same YAML works with ``fedshard fit --config ...``; this script adds what a first run should show: the model and
its size, the validation perplexity of the initial model, Lightning's training run (progress bar, CSV logs), the
perplexity of the consensus model after training, and the consensus with its tokenizer, saved for
``transformers``' ``from_pretrained``.
"""

from __future__ import annotations

import logging
import math
import os
import time
import warnings
from pathlib import Path

import torch
from torch.utils.data import DataLoader
from transformers.utils import logging as hf_logging

from lightning_fedshard.cli import cli
from lightning_fedshard.examples import LlamaLM, ShakespeareDataModule


def quiet() -> None:
    """Keep the console to what this script prints, Lightning's progress bar and real warnings."""
    # Lightning 2.6 builds a torch pytree `LeafSpec` for every data loader, which torch 2.13 deprecates: a warning
    # per rank that no user can act on.
    warnings.filterwarnings("ignore", r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning)
    # Lightning's info lines (seeds, "GPU available", every rank's process-group set-up, a cloud-logging tip) repeat
    # what this script prints; its warnings still show.
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)
    # transformers draws a progress bar for writing one 5 MB file.
    hf_logging.disable_progress_bar()


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
    nll = total_nll / total_tokens if total_tokens else math.nan  # nan with `limit_val_batches: 0`
    return {"ppl": math.exp(nll), "bpb": nll / math.log(2) / bytes_per_token}


def describe(model: LlamaLM, data: ShakespeareDataModule, strategy: str) -> str:
    """What is trained on what: the lines printed before training starts."""
    shape = model.shape
    train_tokens = len(data.train_set) * data.seq_len
    val_tokens = len(data.val_set) * data.seq_len
    return (
        f"Data: Shakespeare's plays, {train_tokens / 1e6:.2f} M training tokens; validation on {val_tokens / 1e3:.0f} k"
        f" tokens of 6 held-out plays (byte-level BPE, {data.vocab_size} tokens)\n"
        f"Model: Llama, {model.num_parameters() / 1e6:.2f} M parameters ({shape.num_layers} layers,"
        f" width {shape.hidden_size}, {shape.num_heads} heads)\n"
        f"Strategy: {strategy}"
    )


def main() -> None:
    started = time.perf_counter()
    quiet()  # in every rank: Lightning runs this script again for each of them
    run = cli(run=False)
    trainer, model, data = run.trainer, run.model, run.datamodule
    assert isinstance(model, LlamaLM) and isinstance(data, ShakespeareDataModule)
    max_val_batches = int(trainer.limit_val_batches) if isinstance(trainer.limit_val_batches, int) else 10**9

    before = None
    if is_launching_process():  # other ranks do not exist yet: they start inside trainer.fit
        data.prepare_data()
        data.setup("validate")
        runtime = getattr(trainer.strategy, "runtime", None)  # the federated strategies' groups and sync options
        print(describe(model, data, runtime.describe() if runtime is not None else type(trainer.strategy).__name__))
        before = evaluate(model, data.val_dataloader(), max_val_batches, data.val_bytes_per_token)
        print(f"Validation before training: perplexity {before['ppl']:.1f}, {before['bpb']:.3f} bits/byte")
        if trainer.world_size > 1:
            print(f"Starting {trainer.world_size - 1} more processes; each loads torch and Lightning first ...")
        model.train()

    trainer.fit(model, datamodule=data)

    # Collective: every rank takes part in gathering the consensus model; global rank 0 receives it.
    state_dict = trainer.strategy.lightning_module_state_dict()
    if trainer.global_rank != 0:
        return
    out = Path(trainer.default_root_dir) / "consensus"
    consensus = LlamaLM(**{k: v for k, v in model.hparams.items() if not k.startswith("_")})
    consensus.load_state_dict(state_dict)
    after = evaluate(consensus, data.val_dataloader(), max_val_batches, data.val_bytes_per_token)
    consensus.save_pretrained(out)  # config.json + model.safetensors
    data.save_tokenizer(out)  # tokenizer.json + tokenizer_config.json
    logs = trainer.logger.log_dir if trainer.logger is not None else "(no logger)"
    assert before is not None  # global rank 0 is the launching process
    print(
        f"Validation perplexity: {before['ppl']:.1f} before -> {after['ppl']:.1f} after training"
        f" ({before['bpb']:.3f} -> {after['bpb']:.3f} bits/byte) in {trainer.global_step} steps,"
        f" {time.perf_counter() - started:.0f} s wall time.\n"
        f"Logs: {logs}\n"
        f"Consensus model and tokenizer (transformers' from_pretrained): {out}"
    )


if __name__ == "__main__":
    main()
