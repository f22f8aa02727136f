"""Writing the generated sections of the docs: the text between ``<!-- generated:NAME -->`` markers, and provenance."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

REPORT_COMMAND = "python -m benchmarks.report --write-docs"


def replace_section(path: Path, name: str, body: str) -> None:
    """Replace the text between ``<!-- generated:name -->`` and ``<!-- /generated:name -->`` in ``path``.

    Raises:
        ValueError: If the markers are missing.
    """
    text = path.read_text()
    start, end = f"<!-- generated:{name} -->", f"<!-- /generated:{name} -->"
    if start not in text or end not in text:
        raise ValueError(f"{path} has no {start} ... {end} section.")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    path.write_text(f"{head}{start}\n{body.strip()}\n{end}{tail}")


def page_with_section(pages: Iterable[Path], name: str) -> Path:
    """The one page of ``pages`` that holds the ``<!-- generated:name -->`` section.

    Raises:
        ValueError: If no page holds it, or more than one does.
    """
    pages = list(pages)
    holding = [page for page in pages if f"<!-- generated:{name} -->" in page.read_text()]
    if len(holding) != 1:
        where = ", ".join(str(page) for page in holding) or f"none of {', '.join(str(page) for page in pages)}"
        raise ValueError(f"One page must hold the <!-- generated:{name} --> section; found it in {where}.")
    return holding[0]


def provenance(results: dict[str, Any]) -> str:
    """Where a sweep's numbers come from: its command, commit, versions and machine.

    The command is the one that reruns the sweep; the exact command line of the run is in the results'
    ``machine.command``.
    """
    m = results["machine"]
    tree = "a clean tree" if m.get("git_dirty") is False else "uncommitted changes"
    return (
        f"Measured with `{rerun_command(results['preset'])}` at commit `{(m.get('git_commit') or '?')[:10]}` ({tree}),"
        f" torch {m['torch']}, Lightning {m['lightning']}, Python {m['python']}, on {m['cpu_count']} cores of"
        f" {m['cpu_model']}. Regenerate these tables with `{REPORT_COMMAND}`."
    )


def rerun_command(preset: str) -> str:
    """The command that runs ``preset`` again."""
    if preset in ("race", "elastic"):
        return f"python -m benchmarks.{preset}"
    return f"python -m benchmarks.run --preset {preset}"
