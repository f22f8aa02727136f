"""Tests of the example Llama language model (single process, CPU, no network)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import lightning as L
import pytest
import torch

from lightning_fedshard.examples import LLAMA_SIZES, LlamaLM, ShakespeareDataModule
from lightning_fedshard.examples.llama import WarmupCosine
from tests.launch import free_port, launch

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


def test_untied_embeddings_add_an_output_matrix() -> None:
    tied, untied = LlamaLM(**TINY), LlamaLM(**TINY, tie_word_embeddings=False)
    assert untied.model.lm_head.weight is not untied.model.model.embed_tokens.weight
    assert untied.num_parameters() == tied.num_parameters() + TINY["vocab_size"] * TINY["hidden_size"]
    # The output projection is a matrix like any other: weight decay applies to it.
    assert "model.lm_head.weight" not in untied._no_decay


def _rope_inv_freq(head_dim: int, theta: float = 10000.0) -> torch.Tensor:
    return 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)


@pytest.mark.parametrize("tie", [True, False])
def test_meta_init_builds_in_configure_model(tie: bool) -> None:
    eager = LlamaLM(**TINY, tie_word_embeddings=tie)
    torch.manual_seed(5)
    state = torch.random.get_rng_state()
    model = LlamaLM(**TINY, tie_word_embeddings=tie, meta_init=True)
    assert "model" not in model._modules  # nothing built yet
    assert model.num_parameters() == eager.num_parameters()
    model.configure_model()  # no Trainer, so no FSDP: materialized here
    network = model.model
    model.configure_model()
    assert model.model is network  # built once
    assert torch.equal(torch.random.get_rng_state(), state)
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    assert (network.lm_head.weight is network.model.embed_tokens.weight) is tie
    torch.testing.assert_close(network.model.rotary_emb.inv_freq, _rope_inv_freq(TINY["hidden_size"] // 2))
    torch.testing.assert_close(network.model.rotary_emb.inv_freq, eager.model.model.rotary_emb.inv_freq)
    for name, param in network.named_parameters():
        if "norm" in name:
            assert torch.equal(param, torch.ones_like(param)), name
        else:  # transformers' normal(0, initializer_range=0.02), as the eager path
            assert param.std().item() == pytest.approx(0.02, rel=0.2), name
            assert not torch.equal(param, eager.model.get_parameter(name)), name  # same law, other draws
    again = LlamaLM(**TINY, tie_word_embeddings=tie, meta_init=True)
    again.configure_model()
    torch.testing.assert_close(again.state_dict(), model.state_dict(), rtol=0, atol=0)
    input_ids = torch.randint(0, TINY["vocab_size"], (2, 8))
    assert torch.isfinite(model(input_ids)).all()


def test_fabric_empty_init_materializes_through_fsdp(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fabric: build inside `init_module(empty_init=True)`; FSDP materializes it with the same values."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    from lightning_fedshard.fabric import FLFSDPStrategy

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    strategy = FLFSDPStrategy(num_groups=1, auto_wrap_policy=LlamaLM.wrap_policy())
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=strategy)
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = LlamaLM(**TINY)
    assert all(param.is_meta for param in model.parameters())
    wrapped = fabric.setup_module(model)
    reference = LlamaLM(**TINY, meta_init=True)
    reference.configure_model()
    with FullyShardedDataParallel.summon_full_params(wrapped._forward_module):
        assert model.model.lm_head.weight.data_ptr() == model.model.model.embed_tokens.weight.data_ptr()
        torch.testing.assert_close(model.model.state_dict(), reference.model.state_dict(), rtol=0, atol=0)
    torch.testing.assert_close(model.model.model.rotary_emb.inv_freq, _rope_inv_freq(TINY["hidden_size"] // 2))


@pytest.mark.slow
def test_meta_init_under_fl_fsdp_materializes_one_unit_at_a_time(tmp_path: Path) -> None:
    """4 ranks, 2 groups x 2 shards, through the Trainer: no rank ever holds more than one unit outside its shards.

    The worker wraps every `reset_parameters` FSDP calls and records, after each, the bytes the model holds in FSDP's
    flat shards and elsewhere (`materialized_bytes`). Without FSDP the same counter reaches the whole model
    (tests/examples/test_meta_init.py), so the bound below fails if materialization ever stops being unit by unit.
    """
    config = {**TINY, "vocab_size": 512, "hidden_size": 64, "num_layers": 3, "num_heads": 4, "intermediate_size": 128}
    config["tie_word_embeddings"] = False
    launch(
        Path(__file__).with_name("meta_worker.py"),
        [json.dumps(config), str(tmp_path), "fsdp1"],
        num_nodes=2,
        devices=2,
        log_dir=tmp_path / "logs",
    )
    reference = LlamaLM(**config, meta_init=True)
    reference.configure_model()
    network = reference.model
    layer_bytes = [_bytes(layer) for layer in network.model.layers]
    total = _bytes(network)
    largest_unit = max([*layer_bytes, total - sum(layer_bytes)])  # root unit: embeddings, output, norm, rotary
    shard_bound = total / 2 + 2 * (len(layer_bytes) + 1) * 4  # FSDP pads each unit to a multiple of 2 values
    full_states = 0
    for rank in range(4):
        seen = torch.load(tmp_path / f"rank{rank}.pt")
        flat, other = zip(*seen["trace"])
        assert len(seen["trace"]) == sum(1 for m in network.modules() if "reset_parameters" in vars(m))
        assert max(layer_bytes) <= max(other) <= largest_unit < total / 2
        assert all(f + o <= shard_bound + largest_unit for f, o in seen["trace"])
        assert flat[-1] <= seen["shard_bytes"] <= shard_bound
        torch.testing.assert_close(seen["inv_freq"], network.model.rotary_emb.inv_freq, rtol=0, atol=0)
        assert all(abs(loss - math.log(config["vocab_size"])) < 0.2 for loss in seen["losses"])
        if seen["initial"]:  # rank 0 of each group gathers the full state dict
            full_states += 1
            expected = {f"model.{k}": v for k, v in network.state_dict().items()}
            torch.testing.assert_close({k: seen["initial"][k] for k in expected}, expected, rtol=0, atol=0)
    assert full_states >= 2


@pytest.mark.slow
def test_meta_init_under_fl_fsdp2_materializes_only_local_shards(tmp_path: Path) -> None:
    """FSDP2: `fully_shard` first, then `to_empty` + `reset_parameters` on the shards; groups start equal and learn.

    FSDP2 materializes the sharded `DTensor` parameters, so a rank only ever allocates its own rows; random init on
    `DTensor` shards draws other numbers than a single process does, so only the invariants are checked: every rank
    of a group reports the same full weights, the same in both groups, the rotary buffer is recomputed, losses start
    at log(vocab).
    """
    config = {**TINY, "vocab_size": 512, "hidden_size": 64, "num_layers": 3, "num_heads": 4, "intermediate_size": 128}
    config["tie_word_embeddings"] = False
    launch(
        Path(__file__).with_name("meta_worker.py"),
        [json.dumps(config), str(tmp_path), "fsdp2"],
        num_nodes=2,
        devices=2,
        log_dir=tmp_path / "logs",
    )
    reference = LlamaLM(**config, meta_init=True)
    reference.configure_model()
    total = _bytes(reference.model)
    seen = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(4)]
    full = [s["initial"] for s in seen if s["initial"]]
    assert full, "no rank gathered the full state dict"
    for state in full[1:]:
        for k, v in full[0].items():
            assert torch.equal(state[k], v)
    buffers = sum(b.numel() * b.element_size() for b in reference.model.buffers())
    for s in seen:
        torch.testing.assert_close(s["inv_freq"], reference.model.model.rotary_emb.inv_freq, rtol=0, atol=0)
        assert all(abs(loss - math.log(config["vocab_size"])) < 0.2 for loss in s["losses"])
        assert s["shard_bytes"] <= (total - buffers) / 2 + 4 * 64 * 4  # its rows only (a few uneven rows of slack)
    stds = {k: float(v.std()) for k, v in full[0].items() if k.endswith("proj.weight")}
    assert stds and all(0.016 < sd < 0.024 for sd in stds.values()), stds  # normal(0, initializer_range=0.02)


def _bytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])
