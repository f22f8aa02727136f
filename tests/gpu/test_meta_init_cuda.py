"""A ~1B Llama built on the meta device and materialized by FSDP on the GPU, with its memory against the planner."""

from __future__ import annotations

import lightning as L
import torch

import lightning_fedshard
from lightning_fedshard.examples import LlamaLM
from lightning_fedshard.plan import TrainSetup
from lightning_fedshard.plan.predict import memory, topology_of
from lightning_fedshard.plan.specs import CLUSTERS, ModelSpec

#: TinyLlama-1.1B's shape (as in benchmarks/init_memory.py).
SHAPE = dict(hidden_size=2048, num_layers=22, num_heads=32, num_kv_heads=4, intermediate_size=5632, vocab_size=32000)


class _Probe(L.Callback):
    def on_train_start(self, trainer, pl_module):
        torch.cuda.synchronize()
        self.after_setup = torch.cuda.max_memory_allocated()
        self.params = sum(s.numel() for s in trainer.strategy.local_shards())


def test_meta_init_of_a_1b_llama_on_the_gpu_stays_within_the_planned_memory():
    torch.cuda.reset_peak_memory_stats()
    model = LlamaLM(**SHAPE, max_seq_len=256, meta_init=True, tie_word_embeddings=False)
    probe = _Probe()
    trainer = L.Trainer(
        accelerator="gpu", devices=1, max_steps=1, callbacks=[probe], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, precision="bf16-true",
        strategy=lightning_fedshard.FLFSDPStrategy(
            auto_wrap_policy=LlamaLM.wrap_policy(), outer_optimizer="nesterov", sync_every=1
        ),
    )  # fmt: skip
    tokens = torch.randint(0, SHAPE["vocab_size"], (2, 256))
    trainer.fit(model, [{"input_ids": tokens, "labels": tokens}])
    assert probe.params > 1.0e9
    root = 2 * SHAPE["vocab_size"] * SHAPE["hidden_size"]  # untied embedding and output projection
    spec = ModelSpec("1.1b", probe.params, root, SHAPE["num_layers"], SHAPE["hidden_size"], SHAPE["num_heads"], 256)
    setup = TrainSetup("fsdp", param_bytes=2, grad_bytes=2, master_bytes=2)
    cluster = CLUSTERS["leonardo-512"]
    planned = memory(spec, setup, topology_of(setup, cluster))
    # Materialized unit by unit: the peak before training is the bf16 weights plus about one unit, never the eager
    # build's float32 copy; the planner's parameter bytes are the floor.
    assert planned.parameters <= probe.after_setup <= 1.25 * planned.parameters + 2 * 2**30
