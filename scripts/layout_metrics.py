"""Measures the package's layout: rooms of core/, the import arrows between them, and the size rules.

    python scripts/layout_metrics.py [PACKAGE_DIR]      (default: lightning_fedshard)

Prints JSON: core's rooms (sub-packages, and its top-level modules as one room "core"), the arrows between rooms
(module-level and function-level imports), the upward ones against the floors below, every class over 400 lines,
every function over 60, the ``# fmt: skip`` markers, and the package files a sync passes through (a plain sync, and a
paced sync of an elastic federation's options, both with in-process groups: the elastic communicator is left out).
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

#: core's floors, bottom first: a room may import from its own floor and those below.
FLOORS = (("options",), ("wire", "transport", "backends"), ("step",), ("rounds",), ("core",))


def _room(module: str) -> str | None:
    parts = module.split(".")
    if len(parts) < 2 or parts[1] != "core":
        return None
    return parts[2] if len(parts) > 3 else "core"


def _floor(room: str) -> int:
    return next(i for i, rooms in enumerate(FLOORS) if room in rooms)


def _imports(tree: ast.AST) -> set[str]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


def sync_files(root: Path, paced: bool) -> list[str]:
    """The package's files whose functions run during one sync of 2 in-process groups (the default sync, or paced)."""
    import threading

    import torch

    from lightning_fedshard import Pace
    from lightning_fedshard.core import FederationConfig
    from lightning_fedshard.core.federation import Federation
    from lightning_fedshard.core.transport.inprocess import InProcessGroups

    pace = Pace(speeds=(1.0, 0.5)) if paced else None
    seen: set[str] = set()
    ready = threading.Barrier(2)  # both groups set up before either traces

    def tracer(frame: object, event: str, arg: object) -> None:
        filename = frame.f_code.co_filename  # type: ignore[attr-defined]
        if event == "call" and filename.startswith(str(root)):
            seen.add(str(Path(filename).relative_to(root.parent)))

    def work(g: int, comm: object) -> None:
        fed = Federation(FederationConfig(sync_every=2, pace=pace), comm)  # type: ignore[arg-type]
        fed.start([torch.zeros(64)], step=0)
        fed.maybe_sync(1)
        ready.wait()
        sys.setprofile(tracer)
        fed.maybe_sync(2)
        sys.setprofile(None)

    InProcessGroups(2).run(work)
    return sorted(seen)


def measure(root: Path) -> dict:
    """Every number of the layout (see the module)."""
    arrows: set[tuple[str, str]] = set()
    big_classes, long_functions, skips = [], [], 0
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        skips += text.count("# fmt: skip")
        tree = ast.parse(text)
        module = ".".join(path.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__")
        source = _room(module)
        for target in _imports(tree):
            if source is not None and (room := _room(target)) is not None and room != source:
                arrows.add((source, room))
        for node in ast.walk(tree):
            size = (node.end_lineno or node.lineno) - node.lineno + 1 if hasattr(node, "lineno") else 0
            if isinstance(node, ast.ClassDef) and size > 400:
                big_classes.append(f"{module}.{node.name}: {size}")
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and size > 60:
                long_functions.append(f"{module}.{node.name}: {size}")
    rooms = sorted({r for arrow in arrows for r in arrow})
    upward = sorted(f"{a} -> {b}" for a, b in arrows if _floor(a) < _floor(b))
    largest = max(
        (
            ((n.end_lineno or 0) - n.lineno + 1, f"{p.relative_to(root.parent)}:{n.name}")
            for p in root.rglob("*.py")
            for n in ast.walk(ast.parse(p.read_text()))
            if isinstance(n, ast.ClassDef)
        ),
    )
    return {
        "rooms": rooms,
        "arrows": len(arrows),
        "upward_arrows": upward,
        "classes_over_400": big_classes,
        "largest_class": f"{largest[1]} ({largest[0]} lines)",
        "functions_over_60": long_functions,
        "fmt_skip": skips,
        "files_of_a_plain_sync": sync_files(root, paced=False),
        "files_of_a_paced_sync": sync_files(root, paced=True),
    }


if __name__ == "__main__":
    print(json.dumps(measure(Path(sys.argv[1] if len(sys.argv) > 1 else "lightning_fedshard").resolve()), indent=1))
