"""Draw docs/images/hierarchical.png: which groups average after each optimizer step, two sites of two groups.

    .venv/bin/python docs/images/hierarchical.py     # needs matplotlib (pip install -e ".[examples]")

``Hierarchical({8: 2, 32: 4})`` on 4 groups: groups 0-1 and 2-3 (the sites) average their weights every 8 steps, and
every 32 steps the whole federation meets and takes the outer step. The schedule comes from the library's own
``Hierarchical.block_size``, so the picture follows the code.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

from lightning_fedshard import Hierarchical  # noqa: E402

LEVELS, GROUPS, STEPS = {8: 2, 32: 4}, 4, 64
SITE, FEDERATION = "#3B6AA0", "#C8682C"


def main() -> None:
    """One column per sync, one row per group; a bar spans the groups that average together."""
    topology = Hierarchical(LEVELS)
    fig, ax = plt.subplots(figsize=(9.0, 2.6), dpi=100)
    for step in range(1, STEPS + 1):
        size = topology.block_size(step)
        if size is None:
            continue
        colour = FEDERATION if size == GROUPS else SITE
        for start in range(0, GROUPS, size):
            ax.add_patch(Rectangle((step - 0.5, start - 0.35), 1.0, size - 0.3, fc=colour, alpha=0.8, ec="none"))
    ax.set_yticks(range(GROUPS), [f"group {g}" for g in range(GROUPS)], fontsize=9)
    ax.set_xticks(range(0, STEPS + 1, 8))
    ax.set_xlim(0, STEPS + 1)
    ax.set_ylim(GROUPS - 0.4, -0.6)
    ax.set_xlabel("optimizer steps completed", fontsize=9)
    ax.set_title(f"Hierarchical({LEVELS}) on {GROUPS} groups", fontsize=10)
    handles = [
        Rectangle((0, 0), 1, 1, fc=SITE, alpha=0.8, label="a site: its groups average their weights"),
        Rectangle((0, 0), 1, 1, fc=FEDERATION, alpha=0.8, label="the federation: the outer step"),
    ]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.32), ncol=2, fontsize=8, frameon=False)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    fig.tight_layout()
    fig.savefig(Path(__file__).with_name("hierarchical.png"), bbox_inches="tight", pad_inches=0.05)


if __name__ == "__main__":
    main()
