"""The SparseLoCo recipe (codecs.SparseLoCo, reducers.GatherMean) against an independent reference of its rules."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from lightning_fedshard import SparseLoCo
from lightning_fedshard.core.config import FederationConfig
from lightning_fedshard.core.transport.inprocess import InProcessGroups
from lightning_fedshard.core.wire.reducers import GatherMean, make_reducer

CHUNK, K, GROUPS, NUMEL = 64, 4, 3, 200  # 4 chunks, the last one padded


def _reference_message(buffer: torch.Tensor) -> torch.Tensor:
    """What one group sends, decoded: the top-K of each chunk on the 4-level table of the message."""
    padded = torch.nn.functional.pad(buffer, (0, 4 * CHUNK - NUMEL)).view(4, CHUNK)
    chosen = torch.zeros_like(padded, dtype=torch.bool)
    for row in range(4):
        chosen[row, padded[row].abs().argsort(descending=True)[:K]] = True
    kept = padded[chosen]
    median = kept.abs().median()
    lo, hi = kept.abs()[kept.abs() <= median].mean(), kept.abs()[kept.abs() > median].mean()
    level = torch.where(kept.abs() > median, hi, lo)
    out = torch.zeros_like(padded)
    out[chosen] = torch.where(kept < 0, -level, level)
    return out.view(-1)[:NUMEL]


def _reference_sync(deltas: list[torch.Tensor], buffers: list[torch.Tensor], mean: str) -> torch.Tensor:
    """One sync of every group: decayed feedback, messages, clip to the median norm, the mean; updates ``buffers``."""
    messages = []
    for g, delta in enumerate(deltas):
        buffers[g] = 0.95 * buffers[g] + delta
        sent = _reference_message(buffers[g])
        buffers[g] = buffers[g] - sent
        messages.append(sent)
    stacked = torch.stack(messages)
    norms = stacked.norm(dim=1)
    stacked = stacked * torch.clamp(norms.median() / norms, max=1.0)[:, None]
    if mean == "all":
        return stacked.sum(0) / GROUPS
    counts = (stacked != 0).sum(0)
    return torch.where(counts > 0, stacked.sum(0) / counts.clamp_min(1), torch.zeros(NUMEL))


@pytest.mark.parametrize("mean", ["selected", "all"])
def test_three_syncs_match_the_reference_rules(mean: str) -> None:
    generator = torch.Generator().manual_seed(0)
    deltas = [[torch.randn(NUMEL, generator=generator) for _ in range(GROUPS)] for _ in range(3)]
    buffers = [torch.zeros(NUMEL) for _ in range(GROUPS)]
    expected = [_reference_sync(step, buffers, mean) for step in deltas]

    def work(g: int, comm: object) -> list[torch.Tensor]:
        reducer = make_reducer(SparseLoCo(top_k=K, chunk_size=CHUNK, mean=mean))
        assert isinstance(reducer, GatherMean)
        return [reducer.sum_across_groups(step[g], comm, GROUPS) / GROUPS for step in deltas]  # type: ignore[arg-type]

    for got in InProcessGroups(GROUPS).run(work):
        for g, e in zip(got, expected):
            assert_close(g, e, rtol=1e-6, atol=1e-6)


def test_a_message_is_the_top_k_of_each_chunk_in_under_a_hundredth_of_float32() -> None:
    codec = SparseLoCo()
    values = torch.randn(3 * 4096 + 5, generator=torch.Generator().manual_seed(1))
    message = codec.encode(values)
    decoded, sent = codec.decode(message, values.numel())
    assert message.numel() == codec.message_bytes(values.numel()) < 0.01 * 4 * values.numel()
    assert int(sent.sum()) == 3 * 64 + 5  # the last chunk holds 5 values (and padding)
    assert (torch.sign(decoded[sent]) == torch.sign(values[sent])).all()
    assert len(set(decoded[sent].abs().tolist())) == 2  # two magnitudes, each with its sign: a table of four levels


def test_a_group_that_sends_zeros_is_not_counted() -> None:
    def work(g: int, comm: object) -> torch.Tensor:
        reducer = make_reducer(SparseLoCo(top_k=K, chunk_size=CHUNK), error_feedback=False)
        x = torch.zeros(NUMEL) if g == 2 else torch.arange(NUMEL, dtype=torch.float32) * (g + 1)
        return reducer.sum_across_groups(x, comm, GROUPS)  # type: ignore[arg-type]

    alone = InProcessGroups(2).run(
        lambda g, comm: make_reducer(SparseLoCo(top_k=K, chunk_size=CHUNK), error_feedback=False).sum_across_groups(
            torch.arange(NUMEL, dtype=torch.float32) * (g + 1), comm, 2
        )
    )
    assert_close(InProcessGroups(GROUPS).run(work)[0], alone[0])  # 2 contributors: the same as 2 groups alone


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(top_k=0), "`top_k`"),
        (dict(top_k=9, chunk_size=8), "`top_k=9` must be at most `chunk_size=8`"),
        (dict(decay=1.5), "`decay` must be a number in"),
        (dict(mean="median"), "`mean` must be 'selected' or 'all'"),
    ],
)
def test_bad_parameters_are_refused(options: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SparseLoCo(**options)  # type: ignore[arg-type]


def test_it_is_a_compressed_reduce_dtype_by_name() -> None:
    assert FederationConfig(reduce_dtype="SparseLoCo").compressed
