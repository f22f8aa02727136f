"""Pre-train the example Llama on Shakespeare with Lightning Fabric and FL+FSDP, in a plain training loop.

    OMP_NUM_THREADS=1 python examples/fabric_shakespeare.py --devices 4 --num-groups 2 --steps 60

Fabric launches the other local ranks itself (it re-runs this script). The federation is invisible in the loop:
the outer step runs inside every ``sync_every``-th ``optimizer.step()``; ``fabric.strategy.finish()`` after the
loop leaves the consensus in every group, and evaluating inside ``fabric.strategy.consensus_weights()`` between
syncs sees the consensus rather than the group's own weights.
"""

from __future__ import annotations

import argparse
import math

import lightning as L
import torch

import lightning_fedshard.fabric
from lightning_fedshard.examples import LlamaLM, ShakespeareDataModule


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--num-groups", type=int, default=2)
    parser.add_argument("--sync-every", type=int, default=8)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--size", default="xs", choices=["xs", "s", "m", "l"])
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--val-batches", type=int, default=8)
    return parser.parse_args()


@torch.no_grad()
def validation_nll(fabric: L.Fabric, model: torch.nn.Module, loader, max_batches: int) -> float:
    """Token-weighted mean NLL over the first batches, averaged over all ranks."""
    model.eval()
    total = torch.zeros(2)
    for i, batch in enumerate(loader):
        if i == max_batches:
            break
        nll = next_token_loss(model, batch, reduction="sum")
        total += torch.stack([nll, torch.tensor(batch["labels"].numel(), dtype=nll.dtype)])
    model.train()
    total = fabric.all_reduce(total, reduce_op="sum")
    return (total[0] / total[1]).item()


def main() -> None:
    args = parse_args()
    strategy = lightning_fedshard.fabric.FLFSDPStrategy(
        num_groups=args.num_groups, sync_every=args.sync_every, auto_wrap_policy=LlamaLM.wrap_policy()
    )
    fabric = L.Fabric(accelerator="cpu", devices=args.devices, strategy=strategy)
    fabric.launch()
    fabric.seed_everything(0)

    data = ShakespeareDataModule(seq_len=128, batch_size=8, vocab_size=4096)
    if fabric.local_rank == 0:
        data.prepare_data()
    fabric.barrier()
    data.setup("fit")

    lm = LlamaLM(size=args.size, vocab_size=4096, max_seq_len=128)
    model = fabric.setup_module(lm.model)  # the bare LlamaForCausalLM, wrapped by FSDP inside its group
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95)))
    train = fabric.setup_dataloaders(torch.utils.data.DataLoader(data.train_set, batch_size=8, shuffle=True))
    val = fabric.setup_dataloaders(torch.utils.data.DataLoader(data.val_set, batch_size=8))

    ppl_before = math.exp(validation_nll(fabric, model, val, args.val_batches))
    fabric.print(f"{strategy.topology}: validation perplexity before training {ppl_before:.1f}")
    step = 0
    while step < args.steps:
        for batch in train:
            loss = next_token_loss(model, batch)
            fabric.backward(loss)
            optimizer.step()  # every sync_every-th call also runs the outer step
            optimizer.zero_grad()
            step += 1
            if step % args.sync_every == 0 and strategy.last_sync_stats is not None:
                stats = strategy.last_sync_stats
                fabric.print(f"step {step}: loss {loss.item():.3f}, sync {stats.num_syncs}, drift {stats.drift:.4f}")
            if step == args.steps:
                break
    strategy.finish()  # consensus in every group, even if the loop stopped between two syncs
    ppl_after = math.exp(validation_nll(fabric, model, val, args.val_batches))
    fabric.print(f"validation perplexity: {ppl_before:.1f} before -> {ppl_after:.1f} after {step} steps")


def next_token_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor], reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of the (already shifted) labels under the wrapped ``LlamaForCausalLM``."""
    logits = model(input_ids=batch["input_ids"], use_cache=False).logits  # (B, T, V)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction=reduction)


if __name__ == "__main__":
    main()
