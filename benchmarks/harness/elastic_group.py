"""A group job of the elastic benchmark: the example's group job with the faults a job carries (see ``faults``).

Started by :class:`~benchmarks.harness.faults.FaultyDemo` with the job's spec as JSON in ``argv[1]``; Lightning re-runs
this script for the job's other ranks.
"""

import json
import os
import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout, for `benchmarks`

    from benchmarks.harness.faults import group_callbacks
    from lightning_fedshard.examples.elastic import run_group

    spec = json.loads(sys.argv[1])
    run_group(spec, lambda events: group_callbacks(spec, events))
    sys.stdout.flush()
    os._exit(0)  # gloo threads may still hold tensors: leave without finalizing the interpreter
