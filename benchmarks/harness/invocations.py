"""Every invocation of a study on record: one JSON line per command, written before its first run starts.

A study's runs may later be rerun, superseded or stopped half-way; its invocations file keeps that the command ran,
when, at which commit and what it set out to do, so no invocation is lost from the record.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path


def record_invocation(log: Path, module: str, argv: list[str], runs: list[str]) -> None:
    """Append one invocation of ``python -m module argv`` that set out to do ``runs`` to the JSON lines file ``log``."""
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent
    ).stdout.strip()
    entry = {
        "at": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": f"python -m {module} {' '.join(argv)}".strip(),
        "commit": commit or None,
        "runs": runs,
    }
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as file:
        file.write(json.dumps(entry) + "\n")
