"""The collectives of a sync over the fed ring: a large sum in parts, and a failure that skips the rest.

No torchft here: the ring is a stand-in whose other group holds the same values.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import Tensor

from lightning_fedshard.core.options.elastic import Elastic
from lightning_fedshard.elastic.collectives import GroupsGone, RingCollectives
from lightning_fedshard.elastic.connection import ManagerConnection

ROOT = Path(__file__).parents[2]


class _Ring:
    """A fed ring of two groups whose other group holds the same values; ``fail_at``: that part's collective fails."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.fail_at, self.parts = fail_at, []

    def allreduce(self, tensors: list[Tensor], options: object) -> object:
        (tensor,) = tensors
        index, fail = len(self.parts), self.fail_at
        self.parts.append(tensor.numel())

        class Work:
            def get_future(self) -> torch.futures.Future:
                future: torch.futures.Future = torch.futures.Future()
                future.set_result(None)  # ended at once, as a sum among live groups
                return future

            def wait(self) -> None:
                if index == fail:
                    raise RuntimeError("peer gone")
                tensor.mul_(2)

        return Work()

    def keep_given_up(self, work: object, buffers: tuple[Tensor, ...]) -> None:
        self.given_up = (work, buffers)


class _Manager:
    def report_error(self, error: BaseException) -> None:
        self.error = error


def _collectives(ring: _Ring, manager: _Manager | None = None) -> RingCollectives:
    connection = ManagerConnection(Elastic(group=0), 0, None, dict, lambda state: None)
    connection.rings, connection.manager = ring, manager or _Manager()
    return RingCollectives(connection)


def test_a_large_sum_over_the_elastic_ring_runs_in_parts_in_flight_together():
    """One gloo ring over a large tensor leaves a slow link idle part of the time: the sum is cut as in one job."""
    ring = _Ring()
    collectives = _collectives(ring)
    values = torch.arange(256 * 1024, dtype=torch.float32)  # 1 MiB: 4 parts of 256 KiB
    tensor = values.clone()
    collectives.sum(tensor)
    assert ring.parts == [65536] * 4 and torch.equal(tensor, 2 * values)
    small = torch.ones(8)
    collectives.sum(small)  # one all-reduce
    assert ring.parts[4:] == [8] and torch.equal(small, torch.full((8,), 2.0))


def test_a_failed_part_leaves_zeros_and_skips_the_rest_of_the_sync():
    ring, manager = _Ring(fail_at=1), _Manager()
    collectives = _collectives(ring, manager)
    tensor = torch.ones(256 * 1024)
    collectives.sum(tensor)
    assert not tensor.any() and collectives.failed and isinstance(manager.error, RuntimeError)
    later = torch.ones(4)
    collectives.sum(later)  # the sync's first failure ends its collectives: zeros, nothing sent
    assert not later.any() and len(ring.parts) == 4


class _Pending:
    """A collective that never ends (its peer hangs)."""

    def __init__(self) -> None:
        self.future: torch.futures.Future = torch.futures.Future()

    def get_future(self) -> torch.futures.Future:
        return self.future

    def wait(self) -> None:
        raise AssertionError("waited on a collective that never ends")


class _HungRing(_Ring):
    def allreduce(self, tensors: list[Tensor], options: object) -> object:
        tensors[0].fill_(7.0)  # what gloo may write while the sum is under way
        self.parts.append(tensors[0].numel())
        return _Pending()


def test_a_sum_is_given_up_once_the_lighthouse_counts_a_group_gone_and_keeps_its_buffers():
    ring, manager = _HungRing(), _Manager()
    collectives = _collectives(ring, manager)
    connection = collectives._connection
    connection.options = Elastic(group=0, peer_check=0.01)
    readings = iter([(), (), (2,)])
    connection.gone_groups = lambda: next(readings)  # type: ignore[method-assign]
    tensor = torch.ones(8)
    collectives.sum(tensor)
    assert not tensor.any() and collectives.failed  # zeros: the gloo writes went to a private copy
    assert isinstance(manager.error, GroupsGone) and manager.error.groups == (2,)
    work, buffers = ring.given_up  # kept until it ends: dropping it would block, and it may still write
    assert isinstance(work, _Pending) and torch.equal(buffers[0], torch.full((8,), 7.0))


def test_with_peer_check_0_the_lighthouse_is_never_read():
    ring = _Ring()
    collectives = _collectives(ring)
    collectives._connection.options = Elastic(group=0, peer_check=0)
    collectives._connection.gone_groups = lambda: pytest.fail("read the lighthouse")  # type: ignore[method-assign]
    tensor = torch.ones(8)
    collectives.sum(tensor)
    assert torch.equal(tensor, torch.full((8,), 2.0))


# -- a group hung inside a sum, on real gloo rings ---------------------------------------------------------------------

GLOO_TIMEOUT = 30.0


def _hung_peer(rank: int, store: str, out: str) -> None:
    """Rank 1 stops (SIGSTOP) before its second sum; rank 0 gives that sum up once the lighthouse (a stand-in here)
    counts group 1 as gone, builds its next ring at once and sums on it, then records what it saw."""
    import os
    import signal
    import time
    from datetime import timedelta

    from lightning_fedshard.elastic.rings import fed_rings

    rings = fed_rings(timedelta(seconds=GLOO_TIMEOUT))
    rings.configure(store, f"fed_{rank}", rank, 2, quorum_id=1, group_rank=0, group_world_size=1, global_ranks=[0, 1])
    connection = ManagerConnection(Elastic(group=rank, peer_check=0.2), rank, None, dict, lambda state: None)
    connection.rings, connection.manager = rings, _Manager()
    collectives = RingCollectives(connection)
    first = torch.full((4,), float(rank + 1))
    collectives.sum(first)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # woken up by the test once rank 0 is done
        collectives.sum(torch.ones(4))  # the peer's given-up sum can still end with this one
        return
    hung_since = time.monotonic()
    connection.gone_groups = lambda: (1,) if time.monotonic() - hung_since > 1.0 else ()  # type: ignore[method-assign]
    given_up = torch.full((4,), 5.0)
    started = time.monotonic()
    collectives.sum(given_up)
    gave_up_after = time.monotonic() - started
    started = time.monotonic()
    rings.configure(store, "fed_0", 0, 1, quorum_id=2, group_rank=0, group_world_size=1, global_ranks=[0])
    rebuilt_in = time.monotonic() - started
    collectives.failed = False
    alone = torch.full((4,), 3.0)
    collectives.sum(alone)
    torch.save({"first": first, "given_up": given_up, "error": repr(connection.manager.error),
                "gave_up_after": gave_up_after, "rebuilt_in": rebuilt_in, "alone": alone,
                "held": len(rings.given_up.held)}, out)  # fmt: skip
    open(out + ".done", "w").close()
    deadline = time.monotonic() + GLOO_TIMEOUT
    while rings.given_up.held[0][0].is_completed() is False and time.monotonic() < deadline:
        time.sleep(0.1)  # the test woke rank 1 up: the given-up sum ends with its sum
    torch.save({"ended": rings.given_up.held[0][0].is_completed(), "given_up": given_up.clone()}, out + ".later")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_sum_with_a_hung_group_is_given_up_when_the_lighthouse_counts_it_gone_not_at_the_timeout(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    from torch.distributed import TCPStore

    from tests.launch import free_port

    pytest.importorskip("torchft")
    port = free_port()
    store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    out = tmp_path / "rank0.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.elastic.test_collectives", str(r), f"127.0.0.1:{port}/x", str(out)],
            env=env,
            cwd=ROOT,
        )  # fmt: skip
        for r in range(2)
    ]
    try:
        deadline = time.monotonic() + 90
        while not Path(f"{out}.done").exists() and time.monotonic() < deadline:
            assert procs[0].poll() is None, "rank 0 ended early"
            time.sleep(0.1)
        seen = torch.load(out)
        procs[1].send_signal(signal.SIGCONT)  # the hung group wakes up: its sum meets the given-up one
        assert procs[0].wait(60) == 0 and procs[1].wait(60) == 0
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
        del store
    assert torch.equal(seen["first"], torch.full((4,), 3.0))
    assert "GroupsGone" in seen["error"] and "group(s) [1]" in seen["error"]
    assert 1.0 < seen["gave_up_after"] < 5.0 < GLOO_TIMEOUT  # the stand-in lighthouse said "gone" after 1 s
    assert seen["rebuilt_in"] < 2.0  # the ring of the next quorum does not wait for gloo's timeout
    assert not seen["given_up"].any() and seen["held"] == 1
    assert torch.equal(seen["alone"], torch.full((4,), 3.0))
    later = torch.load(f"{out}.later")
    assert later["ended"]  # the given-up sum ended once the hung group woke up...
    assert not later["given_up"].any()  # ...writing into its private copy, never into the caller's tensor


if __name__ == "__main__":  # one rank of the hung-peer test
    import sys

    _hung_peer(int(sys.argv[1]), sys.argv[2], sys.argv[3])
