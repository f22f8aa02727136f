"""Draw docs/images/topologies.png: the mixing matrix of the first syncs of Gossip and Sampled on 4 groups.

    .venv/bin/python docs/images/topologies.py     # needs matplotlib (pip install -e ".[examples]")

Each panel is the matrix ``W`` of one sync (row ``i``: the weights group ``i`` gives each group's weights), computed
by the library's own ``weights(round, groups)``, so the picture follows the code.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from lightning_fedshard import Gossip, Mixing, Sampled  # noqa: E402

GROUPS, ROUNDS = 4, 3
TOPOLOGIES: list[tuple[str, Mixing]] = [
    ("Gossip(peers=1)", Gossip(peers=1)),
    ("Sampled(groups_per_round=2)", Sampled(groups_per_round=2)),
    ("all (the default)", Mixing([[1 / GROUPS] * GROUPS] * GROUPS)),
]


def main() -> None:
    """One row per topology, one column per sync."""
    fig, axes = plt.subplots(len(TOPOLOGIES), ROUNDS, figsize=(6.6, 6.4), dpi=100)
    for row, (name, topology) in enumerate(TOPOLOGIES):
        for round in range(ROUNDS):
            ax = axes[row][round]
            matrix = topology.weights(round, GROUPS).numpy()
            ax.imshow(matrix, cmap="Blues", vmin=0.0, vmax=1.0)
            for i in range(GROUPS):
                for j in range(GROUPS):
                    if matrix[i, j] > 0:
                        colour = "white" if matrix[i, j] > 0.6 else "black"
                        ax.text(j, i, f"{matrix[i, j]:.2g}", ha="center", va="center", fontsize=7, color=colour)
            ax.set_xticks(range(GROUPS))
            ax.set_yticks(range(GROUPS))
            ax.tick_params(labelsize=7)
            ax.set_title(f"{name}\nsync {round + 1}" if round == 0 else f"sync {round + 1}", fontsize=8)
    fig.supxlabel("from group j", fontsize=9)
    fig.supylabel("group i takes", fontsize=9)
    fig.tight_layout()
    fig.savefig(Path(__file__).with_name("topologies.png"), bbox_inches="tight", pad_inches=0.05)


if __name__ == "__main__":
    main()
