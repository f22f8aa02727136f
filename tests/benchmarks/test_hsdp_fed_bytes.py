"""The summary of the FL+HSDP cross-group bytes benchmark (benchmarks.hsdp_fed_bytes), on made-up rows."""

from __future__ import annotations

from benchmarks.hsdp_fed_bytes import summarize


def _rows(split: list[int], copies: list[int], same: bool = True) -> list[dict]:
    rows = []
    for repeat, (a, b) in enumerate(zip(split, copies)):
        for pattern, total in (("split", a), ("copies", b)):
            for dtype in ("float32", "int4"):
                for node in range(2):  # two nodes' readers, two other ranks without a counter
                    rows.append(dict(repeat=repeat, reduce_dtype=dtype, pattern=pattern, rank=2 * node,
                                     node_link_bytes=total // 2, sync_bytes=total // 4, seconds=0.1))  # fmt: skip
                    rows.append(dict(repeat=repeat, reduce_dtype=dtype, pattern=pattern, rank=2 * node + 1,
                                     node_link_bytes=None, sync_bytes=total // 4, seconds=0.1))  # fmt: skip
        for dtype in ("float32", "int4"):
            rows.append(dict(repeat=repeat, reduce_dtype=dtype, rank=0, same_anchor=same))
    return rows


def test_summary_is_the_median_over_repeats_of_the_nodes_sum():
    summary = summarize({"rows": _rows([100, 120, 110], [200, 260, 230])})
    assert summary["float32"]["split"]["link_bytes"] == 110 and summary["float32"]["copies"]["link_bytes"] == 230
    assert summary["float32"]["reduction"] == 230 / 110
    assert summary["int4"]["same_anchor_every_rank"]
    assert not summarize({"rows": _rows([10], [20], same=False)})["float32"]["same_anchor_every_rank"]
