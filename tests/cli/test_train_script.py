"""examples/train_shakespeare.py end to end: what its console shows and what it saves (2 ranks, a tiny model)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_fedshard.examples import LlamaLM

pytestmark = pytest.mark.slow  # launches processes

ROOT = Path(__file__).parents[2]


def test_train_script_prints_what_a_user_wants_and_saves_a_loadable_folder(tmp_path: Path) -> None:
    # The main job's own config, shrunk: 2 one-rank groups, a 1-layer model, a byte-level vocabulary, 4 steps.
    overrides = {
        "trainer.devices": 2,
        "trainer.strategy.init_args.num_groups": 2,
        "trainer.strategy.init_args.shard_size": 1,
        "trainer.strategy.init_args.sync_every": 2,
        "trainer.limit_train_batches": 4,
        "trainer.val_check_interval": 2,
        "trainer.default_root_dir": tmp_path / "out",
        "trainer.logger.init_args.save_dir": tmp_path / "out",
        "model.init_args.vocab_size": 256,
        "model.init_args.hidden_size": 32,
        "model.init_args.num_layers": 1,
        "model.init_args.num_heads": 2,
        "model.init_args.intermediate_size": 64,
        "data.init_args.vocab_size": 256,
        "data.init_args.cache_dir": tmp_path / "cache",
        "data.init_args.max_train_windows": 256,
        "data.init_args.max_val_windows": 16,
    }
    args = [f"--{key}={value}" for key, value in overrides.items()]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HOME": str(tmp_path / "hf")}
    script = ROOT / "examples" / "train_shakespeare.py"
    config = ROOT / "configs" / "shakespeare" / "fl_hsdp.yaml"
    run = subprocess.run(
        [sys.executable, str(script), "--config", str(config), *args],
        cwd=tmp_path,
        env=env,
        timeout=300,
        capture_output=True,
        text=True,
    )
    console = run.stdout + run.stderr
    assert run.returncode == 0, console[-3000:]

    shape = {key.split(".")[-1]: value for key, value in overrides.items() if key.startswith("model.")}
    num_parameters = LlamaLM(**shape).num_parameters()  # the whole model, not one rank's shard
    assert f"Model: Llama, {num_parameters / 1e6:.2f} M parameters" in console
    assert "Validation perplexity:" in console and "in 4 steps" in console
    assert "Epoch 0/0" in console and "Epoch 0/-" not in console
    for noise in ("LeafSpec", "litlogger", "Seed set to", "GPU available", "Initializing distributed", "Total params"):
        assert noise not in console, noise

    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tmp_path / "out" / "consensus"
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    text = "ROMEO:\nWhat light\n"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    assert model.config.vocab_size == len(tokenizer) == 256
