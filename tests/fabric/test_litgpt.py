"""litgpt's pretraining loop runs unmodified on the Fabric FL+FSDP strategy, and litgpt's tools read its checkpoints.

4 CPU ranks (2 nodes x 2 = 2 groups of 2): ``litgpt.pretrain.main`` trains 6 steps saving at step 4, is called again
with ``resume="auto"`` and continues from that checkpoint to step 10. ``final/lit_model.pth`` loads strictly into
litgpt's ``GPT`` the way litgpt's tools read it (``checkpoint.get("model", checkpoint)``) and evaluates like the
consensus the strategy holds.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.launch import launch

pytest.importorskip("litgpt")
pytestmark = pytest.mark.slow

WORKER = Path(__file__).parent / "litgpt_worker.py"


def test_litgpt_pretrains_resumes_and_its_tools_read_the_result(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")  # litgpt compiles its model; on the CPU it runs eagerly
    out = tmp_path / "out"
    launch(WORKER, [str(out)], 2, 2, tmp_path / "logs", timeout=300)
    log = (tmp_path / "logs" / "rank0.log").read_text()
    assert f"Resuming training from {out / 'step-00000004' / 'lit_model.pth'}" in log, log[-3000:]
    assert (out / "step-00000008" / "lit_model.pth").is_file()

    from litgpt import Config
    from litgpt.model import GPT

    from tests.fabric.litgpt_worker import CONFIG, evaluate

    checkpoint = torch.load(out / "final" / "lit_model.pth", map_location="cpu", weights_only=False)
    assert checkpoint["step_count"] == checkpoint["iter_num"] == 10
    model = GPT(Config(**CONFIG))
    model.load_state_dict(checkpoint.get("model", checkpoint), strict=True)
    consensus = torch.load(out / "consensus.pt")
    assert consensus["num_steps"] == 10
    assert evaluate(model) == pytest.approx(consensus["loss"], abs=1e-6)
    initial = GPT(Config(**CONFIG))
    assert evaluate(model) < evaluate(initial) - 0.5, "the federation did not learn the pattern"
