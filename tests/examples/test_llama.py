"""Tests of the example Llama language model (single process, CPU, no network)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import lightning as L
import pytest
import torch

from lightning_fedshard.examples import LLAMA_SIZES, LlamaLM, ShakespeareDataModule
from lightning_fedshard.examples.llama import WarmupCosine

TINY: dict[str, Any] = {
    "vocab_size": 256,
    "max_seq_len": 32,
    "hidden_size": 32,
    "num_layers": 2,
    "num_heads": 2,
    "intermediate_size": 64,
}


@pytest.fixture(scope="module")
def byte_data(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ShakespeareDataModule]:
    """A small byte-level (vocab 256) Shakespeare data module, prepared once for the module."""
    root = tmp_path_factory.mktemp("llama")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HOME", str(root / "hf_home"))
        mp.setenv("HF_DATASETS_CACHE", str(root / "hf_datasets"))
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("HF_DATASETS_OFFLINE", "1")
        dm = ShakespeareDataModule(
            cache_dir=str(root / "cache"),
            vocab_size=256,
            seq_len=32,
            batch_size=8,
            max_train_windows=64,
            max_val_windows=16,
        )
        dm.prepare_data()
        dm.setup("fit")
        yield dm


class _LossRecorder(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(
        self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        self.losses.append(float(outputs["loss"]))


class _FakeTrainer:
    """Only what configure_optimizers reads."""

    estimated_stepping_batches = 100


def test_initial_weights_depend_only_on_init_seed() -> None:
    torch.manual_seed(123)
    state = torch.random.get_rng_state()
    first, second = LlamaLM(**TINY, init_seed=0), LlamaLM(**TINY, init_seed=0)
    torch.testing.assert_close(torch.random.get_rng_state(), state)  # the global RNG is left alone
    for a, b in zip(first.parameters(), second.parameters()):
        torch.testing.assert_close(a, b)
    other = LlamaLM(**TINY, init_seed=1)
    assert not torch.equal(first.model.model.embed_tokens.weight, other.model.model.embed_tokens.weight)


@pytest.mark.parametrize("size,millions", [("xs", 1.4), ("s", 4.5)])
def test_preset_sizes(size: Literal["xs", "s"], millions: float) -> None:
    model = LlamaLM(size=size)
    assert model.config.hidden_size == LLAMA_SIZES[size].hidden_size
    assert model.model.lm_head.weight is model.model.model.embed_tokens.weight  # tied
    assert model.num_parameters() == pytest.approx(millions * 1e6, rel=0.05)


def test_wrap_policy_names_the_decoder_layer() -> None:
    model = LlamaLM(**TINY)
    (layer_class,) = LlamaLM.wrap_policy()
    assert sum(isinstance(module, layer_class) for module in model.modules()) == TINY["num_layers"]


def test_optimizer_skips_decay_on_norms_and_embeddings() -> None:
    model = LlamaLM(**TINY, weight_decay=0.1)
    model.trainer = _FakeTrainer()  # type: ignore[assignment]
    config = model.configure_optimizers()
    decay, no_decay = config["optimizer"].param_groups
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)
    assert all(param.ndim == 2 for param in decay["params"])
    # Norm weights (2 per layer + the final one) and the tied embedding.
    assert len(no_decay["params"]) == 2 * TINY["num_layers"] + 2
    assert sum(p.numel() for group in (decay, no_decay) for p in group["params"]) == model.num_parameters()


def test_warmup_cosine_schedule() -> None:
    schedule = WarmupCosine(warmup_steps=10, total_steps=110, min_ratio=0.1)
    assert schedule(0) == pytest.approx(0.1)
    assert schedule(9) == pytest.approx(1.0)
    assert schedule(60) == pytest.approx(0.55)
    assert schedule(110) == schedule(500) == pytest.approx(0.1)
    assert WarmupCosine(warmup_steps=0, total_steps=10)(0) == pytest.approx(1.0)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"size": "xxl"}, "size='xxl'"),
        ({"hidden_size": 30, "num_heads": 4}, "hidden_size=30"),
        ({"num_layers": 0}, "num_layers=0"),
        ({"vocab_size": 0}, "vocab_size=0"),
        ({"lr": -1.0}, "lr=-1.0"),
        ({"betas": (0.9, 1.5)}, r"betas=\(0.9, 1.5\)"),
        ({"warmup_fraction": 1.5}, "warmup_fraction=1.5"),
        ({"min_lr_ratio": -0.1}, "min_lr_ratio=-0.1"),
        ({"num_kv_heads": 3}, "num_kv_heads=3"),
        ({"num_kv_heads": 0}, "num_kv_heads=0"),
        ({"rope_theta": 0.0}, "rope_theta=0.0"),
    ],
)
def test_bad_arguments_raise(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LlamaLM(**{**TINY, **kwargs})


def test_byte_vocabulary_has_one_byte_per_token(byte_data: ShakespeareDataModule) -> None:
    # Only the few non-ASCII characters take more than one byte.
    assert byte_data.val_bytes_per_token == pytest.approx(1.0, rel=1e-3)
    assert int(byte_data.train_set.windows.max()) < 256


def test_training_reduces_loss_and_logs_validation_metrics(byte_data: ShakespeareDataModule, tmp_path: Path) -> None:
    L.seed_everything(0)
    model = LlamaLM(**TINY, lr=1e-2)
    recorder = _LossRecorder()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=5,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[recorder],
        default_root_dir=tmp_path,
    )
    trainer.fit(model, datamodule=byte_data)
    assert len(recorder.losses) == 5
    assert recorder.losses[0] == pytest.approx(math.log(256), rel=0.05)  # a random init guesses uniformly
    assert recorder.losses[-1] < recorder.losses[0] - 0.2

    (metrics,) = trainer.validate(model, datamodule=byte_data, verbose=False)
    assert set(metrics) >= {"val_loss", "val_ppl", "val_bpb"}
    assert all(math.isfinite(value) for value in metrics.values())
    assert metrics["val_ppl"] == pytest.approx(math.exp(metrics["val_loss"]), rel=1e-5)
    expected_bpb = metrics["val_loss"] / math.log(2) / byte_data.val_bytes_per_token
    assert metrics["val_bpb"] == pytest.approx(expected_bpb, rel=1e-5)


def test_save_pretrained_round_trips(tmp_path: Path) -> None:
    from transformers import LlamaForCausalLM

    model = LlamaLM(**TINY)
    model.save_pretrained(tmp_path / "hf")
    loaded = LlamaForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True)
    input_ids = torch.randint(0, 256, (2, 8))
    torch.testing.assert_close(loaded(input_ids).logits, model(input_ids))
