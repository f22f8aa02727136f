"""configs/paper/*.yaml through the `fedshard` CLI parser: the 8B model on the meta device, wrap policy, mesh shape.

No process starts and nothing is allocated: the Trainer is built with `accelerator=cpu` (the configs ask for GPUs),
the strategy's topology is pure arithmetic, and `configure_model` creates Llama-3.1-8B on the meta device.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.pytorch.cli import LightningCLI
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from lightning_fedshard import FLFSDPStrategy, FLHSDPStrategy
from lightning_fedshard.cli import cli
from lightning_fedshard.examples import LlamaLM

ROOT = Path(__file__).parents[2]
CONFIGS = sorted((ROOT / "configs" / "paper").glob("*.yaml"))

#: (strategy class, mesh (fed, replicate, shard)) on 128 nodes x 4 GPUs.
EXPECTED = {
    "fl_fsdp": (FLFSDPStrategy, (128, 1, 4)),
    "fl_hsdp": (FLHSDPStrategy, (16, 8, 4)),
    "fsdp": (FLFSDPStrategy, (1, 1, 512)),
    "hsdp": (FLHSDPStrategy, (1, 128, 4)),
}


def _llama_3_1_8b_parameters() -> int:
    """Counted from the published architecture, independently of transformers."""
    vocab, hidden, layers, heads, kv_heads, ffn = 128_256, 4096, 32, 32, 8, 14_336
    kv_width = hidden // heads * kv_heads
    attention = 2 * hidden * hidden + 2 * hidden * kv_width  # q, o; k, v
    per_layer = attention + 3 * hidden * ffn + 2 * hidden  # SwiGLU and two RMSNorms
    return 2 * vocab * hidden + layers * per_layer + hidden  # untied embeddings, final norm


@pytest.fixture(scope="module", params=CONFIGS, ids=lambda path: path.stem)
def paper_run(request: pytest.FixtureRequest) -> tuple[str, LightningCLI]:
    args = ["--config", str(request.param), "--trainer.accelerator=cpu", "--trainer.logger=false"]
    return request.param.stem, cli(args=args, run=False)


def test_the_configs_exist() -> None:
    assert [path.stem for path in CONFIGS] == sorted(EXPECTED)


def test_model_is_llama_3_1_8b_on_the_meta_device(paper_run: tuple[str, LightningCLI]) -> None:
    _, run = paper_run
    model = run.model
    assert isinstance(model, LlamaLM)
    assert _llama_3_1_8b_parameters() == 8_030_261_248
    assert model.num_parameters() == 8_030_261_248  # counted before the network exists
    assert "model" not in model._modules  # meta_init: nothing built at parse time
    model.trainer = run.trainer  # what Trainer.fit does before calling configure_model
    with run.trainer.precision_plugin.module_init_context():
        model.configure_model()
    params = list(model.parameters())
    assert all(param.is_meta for param in params)  # FSDP will materialize them, one unit at a time
    assert sum(param.numel() for param in params) == 8_030_261_248
    assert model.model.lm_head.weight is not model.model.model.embed_tokens.weight
    # bf16-mixed: the sharded master weights FSDP keeps are float32, the gathered ones bfloat16.
    assert {param.dtype for param in params} == {torch.float32}
    precision = run.trainer.precision_plugin.mixed_precision_config
    assert (precision.param_dtype, precision.reduce_dtype) == (torch.bfloat16, torch.bfloat16)
    assert sum(isinstance(module, LlamaDecoderLayer) for module in model.modules()) == 32


def test_strategy_mesh_wrap_and_checkpoint_policy(paper_run: tuple[str, LightningCLI]) -> None:
    name, run = paper_run
    strategy_class, mesh_shape = EXPECTED[name]
    strategy = run.trainer.strategy
    assert type(strategy) is strategy_class
    assert strategy.topology.mesh_shape == mesh_shape
    assert strategy.topology.world_size == 512
    # Lightning turns the class list into ModuleWrapPolicy objects, for FSDP units and for activation checkpointing.
    assert strategy.kwargs["auto_wrap_policy"]._module_classes == {LlamaDecoderLayer}
    assert strategy._activation_checkpointing_kwargs["auto_wrap_policy"]._module_classes == {LlamaDecoderLayer}
    assert run.trainer.precision == "bf16-mixed"
    assert run.config.trainer.strategy.init_args.reduce_dtype == "bfloat16"
