"""The simulator against the Trainer strategy: every exactness scenario's largest weight difference, recorded.

Runs the scenarios of ``tests/simulate/test_exactness.py`` with the Trainer's ``fl_fsdp2`` (4 processes, one rank per
group) and with the simulator, and writes each mode's largest absolute difference of the final weights to
``benchmarks/results/sim_exact.json`` (the ``sim-exact`` target). From the repository root::

    PYTHONPATH=. python -m benchmarks.sim_exact
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

from benchmarks.recipes import RESULTS as RECIPE_RESULTS
from tests.launch import launch
from tests.simulate.test_exactness import GROUPS, SCENARIOS, WORKER, simulate

RESULTS = RECIPE_RESULTS.parent / "sim_exact.json"


def main() -> None:
    """Run both sides of every scenario and record the differences."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        launch(WORKER, [json.dumps(SCENARIOS), str(out)], num_nodes=1, devices=GROUPS, log_dir=out / "logs")
        rows = {}
        for spec in SCENARIOS:
            expected = torch.load(out / f"{spec['name']}.pt", weights_only=False)["final"]
            got = simulate(spec).modules[0].state_dict()
            rows[spec["name"]] = max((got[k] - v).abs().max().item() for k, v in expected.items())
    RESULTS.write_text(json.dumps({"max_abs_difference": rows, "command": "python -m benchmarks.sim_exact"}, indent=1))
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
