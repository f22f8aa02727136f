"""Draw docs/images/timeline.png: one round of streaming fragments with overlap.

    .venv/bin/python docs/images/timeline.py     # needs matplotlib (pip install -e ".[examples]")

``sync_every=8, fragments=2, sync_delay=1``: a fragment lands every ``K = 8 / 2 = 4`` optimizer steps, in turn. Its
pseudo-gradient is taken after step ``s - 1``, its sum over the groups travels while step ``s`` trains, and after step
``s`` the outer step runs and the fragment's weights are merged with ``merge_alpha``. The schedule is computed by the
library's own functions (``lightning_fedshard.core.step.fragments``), so the picture follows the code.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch, Rectangle  # noqa: E402

from lightning_fedshard.core.step.fragments import landing_fragment  # noqa: E402

SYNC_EVERY, FRAGMENTS, DELAY, STEPS = 8, 2, 1, 16
STEP_FILL, STEP_EDGE = "#E6E6E6", "#8C8C8C"
COLOUR = ["#3B6AA0", "#C8682C"]  # one per fragment
ROW_Y = {"train": 2.0, 0: 1.0, 1: 0.0}  # bottom edge of each row
ROW_H = 0.7


def draw_steps(ax: plt.Axes) -> None:
    """Top row: the optimizer steps every group runs without waiting; step s spans [s - 1, s]."""
    for s in range(1, STEPS + 1):
        ax.add_patch(Rectangle((s - 1 + 0.04, ROW_Y["train"]), 0.92, ROW_H, fc=STEP_FILL, ec=STEP_EDGE, lw=0.8))
        ax.text(s - 0.5, ROW_Y["train"] + ROW_H / 2, str(s), ha="center", va="center", fontsize=9)


def draw_landing(ax: plt.Axes, step: int) -> None:
    """One fragment sync: pseudo-gradient after ``step - DELAY``, sum in flight, outer step and merge after ``step``."""
    fragment = landing_fragment(step, SYNC_EVERY, FRAGMENTS)
    assert fragment is not None
    y, colour, start = ROW_Y[fragment] + ROW_H / 2, COLOUR[fragment], step - DELAY
    ax.add_patch(Rectangle((start, y - 0.13), step - start, 0.26, fc=colour, alpha=0.35, ec=colour, hatch="///"))
    ax.plot([start], [y], marker="v", ms=9, color=colour, zorder=3)
    ax.plot([step], [y], marker="o", ms=9, color=colour, zorder=3)
    ax.text(start - 0.12, y + 0.26, f"after {start}", ha="right", va="bottom", fontsize=8, color=colour)
    ax.text(step + 0.12, y + 0.26, f"lands after {step}", ha="left", va="bottom", fontsize=8, color=colour)


def main() -> None:
    """Draw the steps, every landing in the first two rounds, and the legend; write timeline.png."""
    fig, ax = plt.subplots(figsize=(9.0, 2.9), dpi=100)
    draw_steps(ax)
    for step in range(1, STEPS + 1):
        if landing_fragment(step, SYNC_EVERY, FRAGMENTS) is not None:
            draw_landing(ax, step)
    for boundary in range(SYNC_EVERY, STEPS + 1, SYNC_EVERY):
        ax.axvline(boundary, color="#555555", ls=":", lw=1)
    labels = {ROW_Y["train"]: "optimizer steps\n(every group)", ROW_Y[0]: "fragment 0", ROW_Y[1]: "fragment 1"}
    ax.set_yticks([y + ROW_H / 2 for y in labels], list(labels.values()), fontsize=9)
    ax.set_xticks(range(0, STEPS + 1, 4))
    ax.set_xlabel("optimizer steps completed", fontsize=9)
    ax.set_xlim(-0.2, STEPS + 2.2)
    ax.set_ylim(-0.15, ROW_Y["train"] + ROW_H + 0.15)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ax.tick_params(axis="y", length=0)
    ax.set_title(
        f"sync_every={SYNC_EVERY}, fragments={FRAGMENTS}, sync_delay={DELAY}: a fragment lands every"
        f" {SYNC_EVERY // FRAGMENTS} steps",
        fontsize=10,
    )
    handles = [
        plt.Line2D([], [], marker="v", ls="", color="#444444", label="pseudo-gradient taken, sum starts"),
        Patch(fc="#999999", alpha=0.35, ec="#444444", hatch="///", label="sum over the groups in flight"),
        plt.Line2D([], [], marker="o", ls="", color="#444444", label="outer step, merge with merge_alpha"),
    ]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=3, fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(Path(__file__).with_name("timeline.png"), bbox_inches="tight", pad_inches=0.05)


if __name__ == "__main__":
    main()
