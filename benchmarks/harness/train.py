"""One benchmark run on one emulated node: the example Llama on Shakespeare, through Lightning's multi-node path.

The driver (:mod:`benchmarks.harness.launch`) starts this script once per node, inside the node's network
namespace, with ``NODE_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` set; Lightning's own launcher then re-executes it
once per further local rank (``Trainer(num_nodes=..., devices=...)``), exactly as on a real cluster.

Strategies (all from this package; a baseline is one group averaging with itself, which runs no outer step):

=========  ====================================================  ==============================
name       strategy                                              outer step
=========  ====================================================  ==============================
fsdp       ``FLFSDPStrategy(num_groups=1)``: FULL_SHARD over all  none
hsdp       ``FLHSDPStrategy(num_groups=1)``: shard in a node      none
fl_fsdp    ``FLFSDPStrategy()``: one group per node               every ``sync_every`` steps
fl_hsdp    ``FLHSDPStrategy(num_groups=G)``: shard in a node      every ``sync_every`` steps
=========  ====================================================  ==============================

Global rank 0 writes ``<out>/run.json`` (see :class:`~benchmarks.harness.recorder.BenchRecorder`) and Lightning's
``CSVLogger`` writes the per-step metrics under ``<out>/csv``.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import NoReturn

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger

from benchmarks.harness.config import RunConfig
from benchmarks.harness.process import exit_without_finalization
from benchmarks.harness.recorder import BenchRecorder, MeasuredOuterSync
from lightning_fedshard import Elastic, FLFSDPStrategy, FLHSDPStrategy
from lightning_fedshard.examples import LlamaLM, ShakespeareDataModule

#: Seconds an elastic group's collective or quorum may take: torchft's side's (``torchft_train.TIMEOUT``).
ELASTIC_TIMEOUT = 120.0


def make_strategy(cfg: RunConfig) -> FLFSDPStrategy | FLHSDPStrategy:
    """The package's strategy for ``cfg``, built from its federation record (one FSDP unit per decoder layer)."""
    strategy = FLHSDPStrategy if cfg.strategy.endswith("hsdp") else FLFSDPStrategy
    kwargs = cfg.strategy_kwargs()
    if cfg.elastic_groups:  # this node's job is one group of an elastic federation of every node
        kwargs.update(num_groups=cfg.num_nodes, elastic=elastic_group(cfg))
    return strategy(auto_wrap_policy=LlamaLM.wrap_policy(), use_orig_params=True, **kwargs)


def elastic_group(cfg: RunConfig) -> Elastic:
    """This node's group: the lighthouse and group index from the driver, the settings of torchft's side.

    Every planned group starts the federation and takes part in every sync (torchft's ``min_replica_size``), and a
    collective or a quorum may take ``ELASTIC_TIMEOUT`` seconds, as torchft's side does.
    """
    return Elastic(
        lighthouse=os.environ["TORCHFT_LIGHTHOUSE"],
        group=int(os.environ["FEDSHARD_GROUP"]),
        min_groups=cfg.num_nodes,
        start_groups=cfg.num_nodes,
        timeout=ELASTIC_TIMEOUT,
        quorum_timeout=ELASTIC_TIMEOUT,
        hostname=os.environ["FEDSHARD_NODE_ADDR"],
    )


def make_trainer(cfg: RunConfig) -> L.Trainer:
    """A CPU Trainer for ``cfg`` with the benchmark's recorder; no checkpoints, progress bar or sanity check."""
    recorder = BenchRecorder(cfg)
    return L.Trainer(
        accelerator="cpu",
        devices=cfg.devices,
        num_nodes=1 if cfg.elastic_groups else cfg.num_nodes,
        strategy=make_strategy(cfg),
        precision="32-true",
        max_steps=cfg.max_steps,
        val_check_interval=cfg.val_every,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        callbacks=[recorder, MeasuredOuterSync(recorder)],  # the strategy runs the OuterSync first
        logger=CSVLogger(cfg.out, name="csv", version=""),
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def run(cfg: RunConfig) -> None:
    """Train once; every rank of every node calls this."""
    torch.set_num_threads(1)
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    model = LlamaLM(
        size=cfg.size,  # type: ignore[arg-type]
        vocab_size=cfg.vocab_size,
        max_seq_len=cfg.seq_len,
        lr=cfg.lr,
        init_seed=cfg.init_seed,
        **cfg.model_overrides,  # type: ignore[arg-type]
    )
    data = ShakespeareDataModule(
        cache_dir=cfg.cache_dir,
        seq_len=cfg.seq_len,
        batch_size=cfg.batch_size,
        vocab_size=cfg.vocab_size,
        split="iid",
        max_train_windows=cfg.max_train_windows,
        max_val_windows=cfg.max_val_windows,
    )
    make_trainer(cfg).fit(model, datamodule=data)


def parse_args(argv: list[str] | None = None) -> RunConfig:
    """Read a :class:`RunConfig` given as one JSON object (``--config '{...}'``)."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--config", required=True, help="RunConfig.record() as a JSON object")
    return RunConfig.from_record(json.loads(parser.parse_args(argv).config))


def main(argv: list[str] | None = None) -> NoReturn:
    """Run the configuration given on the command line, then end the process without finalizing the interpreter."""
    run(parse_args(argv))
    exit_without_finalization()


if __name__ == "__main__":
    main()
