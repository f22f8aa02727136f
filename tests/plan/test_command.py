"""`fedshard plan` on the command line."""

from __future__ import annotations

import json
import subprocess
import sys

from lightning_fedshard.plan.command import plan


def test_help_documents_every_input():
    out = subprocess.run(
        [sys.executable, "-m", "lightning_fedshard", "plan", "--help"], capture_output=True, text=True, timeout=120
    ).stdout
    for arg in ("--model", "--cluster", "--inter_gbit_per_s", "--step_seconds", "--sync_every", "--reduce_dtype",
                "--sweep", "--json"):  # fmt: skip
        assert arg in out
    assert "Network bandwidth of one node (Gbit/s)" in " ".join(out.split())


def test_table_and_json(capsys):
    predictions = plan(model="xs", cluster="emulated-4x2", micro_batch=4, precision="fp32", inter_gbit_per_s=0.05)
    table = capsys.readouterr().out
    assert [p.setup.strategy for p in predictions] == ["fsdp", "hsdp", "fl_fsdp", "fl_hsdp"]
    assert "| fl_fsdp | 4 x 1 x 2 |" in table
    plan(model="xs", cluster="emulated-4x2", json=True, sweep=True, top=3)
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 3 and {"tokens_per_second", "bottleneck", "collectives"} <= set(rows[0])


def test_bad_input_is_one_line_naming_the_value():
    run = subprocess.run(
        [sys.executable, "-m", "lightning_fedshard", "plan", "--micro_batch", "0"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode != 0
    assert run.stderr.strip().splitlines()[-1] == "fedshard plan: error: `micro_batch=0` must be a positive number."
    assert "Traceback" not in run.stderr
