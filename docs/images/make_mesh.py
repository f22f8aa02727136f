"""Draw docs/images/mesh.png: 8 ranks as 2 federation groups x 2 replicas x 2 shards (FL+HSDP).

    python docs/images/make_mesh.py        # needs matplotlib (pip install -e ".[examples]")

Each group is two nodes (one replica each) of two GPUs (one shard each). The lines show which ranks talk: inside a
node every step ("shard" axis), inside a group every step ("replicate" axis), and across groups only every
``sync_every`` steps ("fed" axis, the outer all-reduce).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

G, R, S = 2, 2, 2  # groups, replicas per group, shards per replica
F = R * S  # ranks per group
EDGE = ["#3B6AA0", "#C8682C"]  # one colour per group
FILL = ["#DCE6F2", "#F8E3D4"]
FED = "#2E8B3E"
SIDE = 0.9  # side of one GPU square
GROUP_X = [0.0, 5.0]  # left edge of each group box
GROUP_W, GROUP_H = 3.6, 4.2
NODE_Y = [2.25, 0.15]  # bottom edge of the node of replica 0 (top) and replica 1
NODE_H = 1.8


def centre(g: int, r: int, s: int) -> tuple[float, float]:
    """Centre of the square of the rank at mesh coordinates (g, r, s)."""
    return GROUP_X[g] + 1.35 + 1.5 * s, NODE_Y[r] + NODE_H / 2


def draw_group(ax: plt.Axes, g: int) -> None:
    """One federation group: its box, its nodes (replicas), its ranks and the per-step links between them."""
    x0 = GROUP_X[g]
    ax.add_patch(FancyBboxPatch((x0, 0), GROUP_W, GROUP_H, boxstyle="round,pad=0.05", fc=FILL[g], ec=EDGE[g], lw=2))
    # group title on the outer side, so the outer all-reduce arcs above and below never cross it
    title_x = x0 - 0.35 if g == 0 else x0 + GROUP_W + 0.35
    ax.text(
        title_x,
        GROUP_H / 2,
        f"federation group {g}",
        rotation=90 if g == 0 else -90,
        ha="center",
        va="center",
        fontsize=13,
        fontweight="bold",
        color=EDGE[g],
    )
    for r in range(R):
        y0 = NODE_Y[r]
        ax.add_patch(
            FancyBboxPatch(
                (x0 + 0.15, y0), GROUP_W - 0.3, NODE_H, boxstyle="round,pad=0.02", fc="white", ec="#999999", lw=1
            )
        )
        ax.text(
            x0 + 0.45,
            y0 + NODE_H / 2,
            f"node {g * R + r}\nreplica {r}",
            rotation=90,
            ha="center",
            va="center",
            fontsize=8.5,
            color="#555555",
            linespacing=1.2,
        )
        for s in range(S):
            cx, cy = centre(g, r, s)
            ax.add_patch(
                FancyBboxPatch(
                    (cx - SIDE / 2, cy - SIDE / 2),
                    SIDE,
                    SIDE,
                    boxstyle="round,pad=0.02",
                    fc=EDGE[g],
                    ec="black",
                    lw=1,
                    zorder=3,
                )
            )
            ax.text(
                cx,
                cy + 0.16,
                f"rank {g * F + r * S + s}",
                ha="center",
                va="center",
                fontsize=10.5,
                color="white",
                fontweight="bold",
                zorder=4,
            )
            ax.text(cx, cy - 0.2, f"({g}, {r}, {s})", ha="center", va="center", fontsize=9, color="white", zorder=4)
        # "shard" axis: the GPUs of one node all-gather and reduce-scatter every step
        (lx, ly), (rx, _) = centre(g, r, 0), centre(g, r, 1)
        ax.plot([lx + SIDE / 2, rx - SIDE / 2], [ly, ly], color="black", lw=2.5, zorder=2)
    # "replicate" axis: the same shard in the group's two nodes, gradient all-reduce every step
    for s in range(S):
        (tx, ty), (_, by) = centre(g, 0, s), centre(g, 1, s)
        ax.plot([tx, tx], [ty - SIDE / 2, by + SIDE / 2], color="black", lw=1.5, ls=(0, (4, 2)), zorder=2)


def draw_fed_links(ax: plt.Axes) -> None:
    """The outer all-reduce: arcs between the ranks at the same in-group position of every group."""
    # "fed" axis: the ranks at the same (replica, shard) in every group; replica 0 arcs above, replica 1 below
    for r in range(R):
        sign = 1 if r == 0 else -1
        for s in range(S):
            (ax_, ay), (bx, by) = centre(0, r, s), centre(1, r, s)
            start, end = (ax_, ay + sign * SIDE / 2), (bx, by + sign * SIDE / 2)
            ax.add_patch(
                FancyArrowPatch(
                    start,
                    end,
                    connectionstyle=f"arc3,rad={-sign * (0.36 + 0.1 * s)}",
                    arrowstyle="-",
                    color=FED,
                    lw=2.4,
                    ls=(0, (1, 1.4)),
                    zorder=1,
                )
            )
    fed_groups = [[g * F + r * S + s for g in range(G)] for r in range(R) for s in range(S)]
    pairs = "  ".join("{" + ", ".join(map(str, ranks)) + "}" for ranks in fed_groups)
    ax.text(
        GROUP_X[1] / 2 + GROUP_W / 2,
        5.05,
        f"outer all-reduce groups: {pairs}",
        ha="center",
        va="bottom",
        fontsize=10.5,
        color=FED,
        fontweight="bold",
    )


def main() -> None:
    """Draw the mesh and save it next to this script."""
    fig, ax = plt.subplots(figsize=(10, 7), dpi=110)
    for g in range(G):
        draw_group(ax, g)
    draw_fed_links(ax)
    shard_label = '"shard" axis: FSDP all-gather / reduce-scatter inside a node, every step'
    ax.plot([], [], color="black", lw=2.5, label=shard_label)
    ax.plot(
        [],
        [],
        color="black",
        lw=1.5,
        ls=(0, (4, 2)),
        label='"replicate" axis: gradient all-reduce between the nodes of a group, every step',
    )
    ax.plot(
        [],
        [],
        color=FED,
        lw=2.4,
        ls=(0, (1, 1.4)),
        label='"fed" axis: outer all-reduce of local shards, every sync_every steps only',
    )
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, 0.1), frameon=False, fontsize=10.5)
    ax.set_title(
        "Mesh (G, R, S) = (2, 2, 2), axes (fed, replicate, shard)\n"
        "rank = g*F + r*S + s   with group size F = R*S = 4, shard size S = 2",
        fontsize=12,
    )
    ax.set_xlim(-0.8, 9.4)
    ax.set_ylim(-2.0, 5.5)
    ax.set_aspect("equal")
    ax.axis("off")
    out = Path(__file__).with_name("mesh.png")
    fig.savefig(out, bbox_inches="tight")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
