"""An elastic group the way users run Lightning: Trainer defaults (sanity check, validation), a module nobody here
wrote, and fit, validate, test and predict on the same Trainer."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # launches processes

pytest.importorskip("torchft")

SCRIPT = textwrap.dedent(
    """
    import sys
    import lightning as L
    from lightning.pytorch.demos.boring_classes import BoringModel
    import lightning_fedshard

    elastic = lightning_fedshard.Elastic(lighthouse=sys.argv[1], group=0, federation="boring", quorum_timeout=60)
    strategy = lightning_fedshard.FLFSDPStrategy(num_groups=2, sync_every=4, elastic=elastic)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=8, default_root_dir=sys.argv[2])
    model = BoringModel()
    trainer.fit(model)
    syncs = trainer.strategy.runtime.last_sync_stats.num_syncs
    print("FIT", trainer.global_step, syncs, trainer.sanity_checking is False)
    print("VALIDATE", sorted(trainer.validate(model)[0]))
    print("TEST", sorted(trainer.test(model)[0]))
    print("PREDICT", len(trainer.predict(model)))
    """
)


def test_boring_model_with_trainer_defaults_fits_validates_tests_and_predicts(tmp_path: Path) -> None:
    from torchft._torchft import LighthouseServer

    script = tmp_path / "boring.py"
    script.write_text(SCRIPT)
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=1000, heartbeat_timeout_ms=5000)
    try:
        run = subprocess.run(
            [sys.executable, str(script), lighthouse.address(), str(tmp_path / "out")],
            capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
        )  # fmt: skip
    finally:
        lighthouse.shutdown()
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    lines = {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in run.stdout.splitlines() if " " in line}
    assert lines["FIT"] == "8 2 True"  # two syncs of the group with the lighthouse, after the sanity check
    assert "PREDICT" in lines and lines["PREDICT"] == "32"
    assert "VALIDATE" in lines and "TEST" in lines
