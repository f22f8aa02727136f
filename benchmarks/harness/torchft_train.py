"""One node of the torchft baseline: the example Llama on Shakespeare with torchft's own ``DiLoCo`` in a plain loop.

A user who trains across sites without this package would run torchft: one replica group per node, a ``Manager`` per
rank that meets the others through a lighthouse, and ``torchft.local_sgd.DiLoCo`` (streaming DiLoCo with fragments
and ``fragment_sync_delay``) around a plain PyTorch loop, as torchft's own examples and tests do. This script is that
loop with the benchmark's model, data, batch, inner optimizer and schedule, so that it compares with
:mod:`benchmarks.harness.train` run with one rank per node:

- the same ``LlamaLM`` (``init_seed``), its AdamW parameter groups and warm-up + cosine schedule over ``max_steps``;
- the same data: the IID training windows, shuffled by a ``DistributedSampler`` over the nodes (what Lightning puts
  in place of the data module's sampler with one rank per node);
- the outer optimizer torchtitan uses with torchft: SGD, learning rate 0.7, momentum 0.9, Nesterov (float32 traffic:
  torchft's quantized all-reduce needs CUDA);
- one rank per replica group (torchft's DiLoCo wraps plain modules; inside a group both systems would shard).

The driver starts it once per node inside the node's namespace with ``NODE_RANK``, the node's own address
(``FEDSHARD_NODE_ADDR``) and the lighthouse (``TORCHFT_LIGHTHOUSE``). Node 0 writes ``<out>/run.json`` in the subset
of :class:`~benchmarks.harness.recorder.BenchRecorder`'s layout that :mod:`benchmarks.torchft` reads: ``steps``
(clock after every optimizer step), ``syncs`` (the steps whose optimizer step synced, with their seconds), ``vals``,
``tokens_per_step``, ``train_seconds``.

A failure run (:mod:`benchmarks.torchft_kill`) sets three more variables per node: ``FEDSHARD_EVENTS``, a folder where
the node writes ``events.jsonl`` (``trained``, ``step``, ``sync`` with its participants, whether it committed and its
seconds, ``killed``, ``end``); ``FEDSHARD_MIN_GROUPS``, the fewest replica groups a sync commits with (torchft's
``min_replica_size``; default: every node); and, on the victim only, ``FEDSHARD_KILL_AT``: the node kills itself
(SIGKILL, the whole replica group: it has one rank) right after that optimizer step.
"""

from __future__ import annotations

import json
import math
import os
import signal
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

import torch
from torch import nn
from torch.distributed import TCPStore
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import DataLoader, DistributedSampler

from benchmarks.harness.config import RunConfig
from benchmarks.harness.process import exit_without_finalization
from benchmarks.harness.recorder import LINK_COUNTER
from benchmarks.harness.train import parse_args
from lightning_fedshard.examples import LlamaLM, ShakespeareDataModule
from lightning_fedshard.examples.llama import WarmupCosine, _clean_name

#: torchtitan's outer optimizer for torchft's DiLoCo.
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9
#: Seconds torchft waits for a collective or a quorum (a float32 sum takes about 13 s at 5 Mbit/s here).
TIMEOUT = 120.0
#: What a failure run sets per node (see the module docstring).
EVENTS_ENV, MIN_GROUPS_ENV, KILL_AT_ENV = "FEDSHARD_EVENTS", "FEDSHARD_MIN_GROUPS", "FEDSHARD_KILL_AT"


class Events:
    """``events.jsonl`` of one node of a failure run (nothing outside one), one JSON object per line with its time."""

    def __init__(self, folder: str | None) -> None:
        self._file = None
        if folder:
            Path(folder).mkdir(parents=True, exist_ok=True)
            self._file = open(Path(folder) / "events.jsonl", "w")

    def write(self, event: str, step: int, **fields: Any) -> None:
        """Append one event, flushed at once (the node may be killed right after)."""
        if self._file is not None:
            self._file.write(json.dumps({"event": event, "step": step, **fields, "t": time.time()}) + "\n")
            self._file.flush()


def inner_optimizer(module: LlamaLM, cfg: RunConfig) -> tuple[torch.optim.Optimizer, LambdaLR]:
    """The module's own AdamW and schedule (``configure_optimizers`` without a Trainer: ``max_steps`` long)."""
    hparams = module.hparams
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for name, param in module.named_parameters():
        (no_decay if _clean_name(name) in module._no_decay else decay).append(param)
    groups = [{"params": decay, "weight_decay": hparams["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=hparams["lr"], betas=tuple(hparams["betas"]))
    schedule = WarmupCosine(
        warmup_steps=round(hparams["warmup_fraction"] * cfg.max_steps),
        total_steps=cfg.max_steps,
        min_ratio=hparams["min_lr_ratio"],
    )
    return optimizer, LambdaLR(optimizer, schedule)


def fragments(module: LlamaLM, count: int) -> list[nn.Module]:
    """``count`` model fragments for streaming DiLoCo: consecutive decoder layers, the first holding the embedding
    and the last the final norm and output head (the whole model with ``count=1``)."""
    if count == 1:
        return [module.model]
    model = module.model.model
    layers = list(model.layers)
    per = math.ceil(len(layers) / count)
    parts: list[list[nn.Module]] = [layers[i * per : (i + 1) * per] for i in range(count)]
    parts[0].insert(0, model.embed_tokens)
    parts[-1] += [model.norm, module.model.lm_head] if not module.model.config.tie_word_embeddings else [model.norm]
    return [nn.ModuleList(part) for part in parts]


@torch.no_grad()
def validate(module: LlamaLM, data: ShakespeareDataModule, batch_size: int) -> dict[str, float]:
    """Token-weighted validation loss and perplexity over every validation window."""
    module.eval()
    total, tokens = 0.0, 0
    for batch in DataLoader(data.val_set, batch_size=batch_size):
        n = batch["labels"].numel()
        total += float(module._nll(batch)) * n
        tokens += n
    module.train()
    loss = total / tokens
    return {"val_loss": loss, "val_ppl": math.exp(loss)}


def _link_tx() -> int | None:
    """Bytes this node has sent into its emulated link (``None`` outside an emulated node)."""
    return int(Path(LINK_COUNTER).read_text()) if os.path.exists(LINK_COUNTER) else None


def _load(module: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """What a healing replica group takes from a peer (torchft's ``load_state_dict`` callback)."""
    module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optim"])


def run(cfg: RunConfig) -> None:
    """Train this node's replica group; node 0 writes ``run.json``."""
    from torchft import Manager, ProcessGroupGloo
    from torchft.local_sgd import DiLoCo

    torch.set_num_threads(1)
    torch.manual_seed(cfg.seed)
    group, groups = int(os.environ["NODE_RANK"]), cfg.num_nodes
    address = os.environ["FEDSHARD_NODE_ADDR"]
    federation = cfg.federation
    module = LlamaLM(
        size=cfg.size,  # type: ignore[arg-type]
        vocab_size=cfg.vocab_size, max_seq_len=cfg.seq_len, lr=cfg.lr, init_seed=cfg.init_seed,
        **cfg.model_overrides,  # type: ignore[arg-type]
    )  # fmt: skip
    data = ShakespeareDataModule(
        cache_dir=cfg.cache_dir, seq_len=cfg.seq_len, batch_size=cfg.batch_size, vocab_size=cfg.vocab_size,
        split="iid", max_train_windows=cfg.max_train_windows, max_val_windows=cfg.max_val_windows,
    )  # fmt: skip
    data.prepare_data()
    data.setup("fit")
    sampler: DistributedSampler = DistributedSampler(
        data.train_set, num_replicas=groups, rank=group, shuffle=True, seed=cfg.seed
    )
    sampler.set_epoch(0)
    loader = DataLoader(data.train_set, batch_size=cfg.batch_size, sampler=sampler, drop_last=True)
    optimizer, scheduler = inner_optimizer(module, cfg)
    parts = fragments(module, federation.fragments)
    outer = [torch.optim.SGD(part.parameters(), lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True) for part in parts]
    store = TCPStore(address, 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=TIMEOUT)),
        load_state_dict=lambda state: _load(module, optimizer, state),
        state_dict=lambda: {"model": module.state_dict(), "optim": optimizer.state_dict()},
        min_replica_size=int(os.environ.get(MIN_GROUPS_ENV, groups)),
        use_async_quorum=False,
        replica_id=f"bench_{group}",
        store_addr=address,
        store_port=store.port,
        rank=0,
        world_size=1,
        hostname=address,
        timeout=timedelta(seconds=TIMEOUT),
        quorum_timeout=timedelta(seconds=TIMEOUT),
        init_sync=False,  # every group builds the same initial weights (init_seed): nothing to heal at step 0
    )
    tokens_per_step = cfg.batch_size * cfg.seq_len * groups
    steps: list[dict[str, Any]] = []
    syncs: list[dict[str, Any]] = []
    vals: list[dict[str, Any]] = []
    validation_seconds = 0.0
    events = Events(os.environ.get(EVENTS_ENV))
    kill_at = int(os.environ.get(KILL_AT_ENV, 0))
    try:
        with DiLoCo(
            manager, parts, optimizer, outer if len(outer) > 1 else outer[0], sync_every=federation.sync_every,
            fragment_sync_delay=federation.sync_delay, fragment_update_alpha=federation.merge_alpha,
        ) as _:  # fmt: skip
            start, tx_start, cpu_start = time.perf_counter(), _link_tx(), time.process_time()
            events.write("trained", 0)
            for step, batch in enumerate(loader, start=1):
                began, synced_before = time.perf_counter(), manager.current_step()
                module._nll(batch).backward()
                optimizer.step()  # DiLoCo's hook syncs a fragment every sync_every / fragments steps
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                ended = time.perf_counter()
                committed = manager.current_step() != synced_before
                if committed:
                    syncs.append({"step": step, "seconds": ended - began})
                steps.append({"step": step, "clock": ended - start - validation_seconds})
                if step % federation.sync_every == 0:  # DiLoCo (one fragment) tried a sync in this step
                    events.write(
                        "sync", step, participants=manager.num_participants(), committed=committed,
                        seconds=ended - began,
                    )  # fmt: skip
                events.write("step", step)
                if step == kill_at:
                    events.write("killed", step)
                    os.kill(os.getpid(), signal.SIGKILL)
                if step % cfg.val_every == 0 or step == cfg.max_steps:
                    measured = time.perf_counter()
                    scores = validate(module, data, cfg.batch_size)
                    vals.append({"step": step, "tokens": step * tokens_per_step, **scores})
                    validation_seconds += time.perf_counter() - measured
                if step == cfg.max_steps:
                    break
            train_seconds = time.perf_counter() - start - validation_seconds
            cpu_seconds = time.process_time() - cpu_start  # validation included, as the recorder counts it
            tx_end = _link_tx()
            events.write("end", step)
    finally:
        manager.shutdown(wait=False)
    out = Path(cfg.out)
    if tx_start is not None and tx_end is not None:  # validation sends nothing: every node scores on its own
        (out / f"link_tx{group}.json").write_text(json.dumps({"train": tx_end - tx_start}))
    if group == 0:
        record = {
            "config": cfg.record(),
            "kind": "torchft",
            "world_size": groups,
            "num_parameters": module.num_parameters(),
            "tokens_per_step": tokens_per_step,
            "train_seconds": train_seconds,
            "cpu_seconds": [cpu_seconds],
            "steps": steps,
            "syncs": syncs,
            "vals": vals,
            "outer_syncs": manager.current_step(),
        }
        tmp = out / "run.json.tmp"
        tmp.write_text(json.dumps(record, indent=1))
        tmp.replace(out / "run.json")


def main(argv: list[str] | None = None) -> NoReturn:
    """Run the configuration given on the command line, then end without finalizing the interpreter."""
    run(parse_args(argv))
    exit_without_finalization()


if __name__ == "__main__":
    main()
