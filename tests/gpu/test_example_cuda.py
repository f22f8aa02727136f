"""The Shakespeare example on one GPU: a short FL+FSDP run from the README's config that shows learning."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # launches processes

REPO = Path(__file__).resolve().parents[2]


def test_the_shakespeare_example_learns_on_the_gpu(tmp_path):
    args = [
        "--config", "configs/shakespeare/fl_hsdp.yaml", "--trainer.accelerator", "gpu", "--trainer.devices", "1",
        "--trainer.strategy.num_groups", "1", "--trainer.strategy.shard_size", "1",
        "--trainer.strategy.outer_optimizer", "nesterov", "--trainer.limit_train_batches", "32",
        "--trainer.val_check_interval", "32", "--trainer.default_root_dir", str(tmp_path),
        "--trainer.logger.init_args.save_dir", str(tmp_path),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = subprocess.run(
        [sys.executable, "examples/train_shakespeare.py", *args], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=900,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    found = re.search(r"perplexity: ([\d.]+) before -> ([\d.]+) after", run.stdout)
    assert found, run.stdout[-2000:]
    before, after = map(float, found.groups())
    assert after < 0.5 * before
