"""The outer step's cost on a GPU for a 1.1B model, next to one inner training step of the same model.

Times, on one GPU with the anchor in pinned host memory (the default ``anchor_device="cpu"``): taking the
pseudo-gradient of the whole model (4.4 GB of float32 shards), the int4 encode / decode / local sum of the sum over
two groups (a loopback ring: what the codec computes, not the network), the outer optimizer step (Nesterov, on the
host anchor) with writing the anchor back, and one forward + backward + AdamW step of the model in bfloat16 on a
batch of 8 x 256 tokens. Medians of 5 repeats after one warm-up. Writes a JSON object to the path given.

    python scripts/device_outer_step.py OUT.json
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable

import torch

from lightning_fedshard.core.config import FederationConfig
from lightning_fedshard.core.step.outer import OuterStep
from lightning_fedshard.examples import LlamaLM

SHAPE = dict(hidden_size=2048, num_layers=22, num_heads=32, num_kv_heads=4, intermediate_size=5632, vocab_size=32000)


class Loopback:
    """A two-member fed ring where the other member sends what this one sends: all of the codec's work, no network."""

    group_index = 0

    def participants(self) -> tuple[int, ...]:
        """Two members: this rank and its echo."""
        return (0, 1)

    def sum_over_groups(self, tensor: torch.Tensor) -> None:
        """Twice this rank's values."""
        tensor.mul_(2)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """Both halves from this rank's first part."""
        half = input.numel() // 2
        output[:half].copy_(input[:half])
        output[half:].copy_(input[:half])

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """This rank's piece twice."""
        output.view(2, -1).copy_(input.view(1, -1).expand(2, -1))

    def sum_in_group(self, tensor: torch.Tensor) -> None:
        """One rank per group: nothing to add."""

    def should_commit(self) -> bool:
        """Always."""
        return True


def _median_seconds(run: Callable[[], object], repeats: int = 5) -> tuple[float, list[float]]:
    run()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        run()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times), times


def main(out: str) -> None:
    """Time the outer step and one inner step; print and write the JSON to ``out``."""
    if not torch.cuda.is_available():
        raise SystemExit("device_outer_step.py needs a CUDA GPU (torch.cuda.is_available() is False).")
    model = LlamaLM(**SHAPE, max_seq_len=256, tie_word_embeddings=False).cuda()
    shards = [p.data for p in model.parameters()]
    config = FederationConfig(outer_optimizer="nesterov")  # the default int4 with error feedback
    outer = OuterStep(shards, config.outer_optimizer_factory, Loopback(), reducer=config.reducer)
    results: dict[str, object] = {"parameters": sum(s.numel() for s in shards), "gpu": torch.cuda.get_device_name()}
    results["outer_step_seconds"], results["outer_step_runs"] = _median_seconds(lambda: outer.step())
    pending = outer.begin(0, background=False)
    results["pseudogradient_and_sum_seconds"], _ = _median_seconds(lambda: outer.begin(0, background=False))
    outer.complete(pending)
    model = model.to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, SHAPE["vocab_size"], (8, 256), device="cuda")

    def inner_step() -> None:
        loss = model.model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    results["inner_step_seconds"], results["inner_step_runs"] = _median_seconds(inner_step)
    results["outer_over_inner"] = results["outer_step_seconds"] / results["inner_step_seconds"]  # type: ignore[operator]
    results["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    print(json.dumps(results, indent=2))
    with open(out, "w") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "device_outer_step.json")
