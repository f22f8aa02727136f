"""What produced a sweep's numbers: machine, versions, command, commit and a digest of the code that ran."""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def machine(module: str) -> dict[str, Any]:
    """The record of this machine and checkout (``module``: the command's module, for the command line)."""
    import lightning
    import torch

    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu_model(),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "command": " ".join([f"python -m {module}", *sys.argv[1:]]),
        **git_state(REPO),
        "source_sha256": source_digest(REPO),
        "source_root": str(REPO),
    }


def git_state(root: Path) -> dict[str, Any]:
    """Commit and working-tree state of ``root`` (all ``None`` outside a git checkout, e.g. in a copy)."""
    commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True)
    # Read-only (no index refresh): which tracked files differ from the commit, and untracked ones.
    status = subprocess.run(
        ["git", "--no-optional-locks", "-C", str(root), "status", "--porcelain"], capture_output=True, text=True
    )
    if commit.returncode or status.returncode:
        return {"git_commit": None, "git_status": None, "git_dirty": None}
    return {
        "git_commit": commit.stdout.strip(),
        "git_status": status.stdout.splitlines(),
        "git_dirty": bool(status.stdout.strip()),
    }


def source_digest(root: Path) -> str:
    """SHA-256 over the Python sources of the package and the benchmarks under ``root`` (paths and contents).

    The commit does not say which code ran when the working tree is dirty; this does.
    """
    digest = hashlib.sha256()
    for path in sorted([*root.glob("lightning_fedshard/**/*.py"), *root.glob("benchmarks/**/*.py")]):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def cpu_model() -> str:
    """The CPU's model name."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()
