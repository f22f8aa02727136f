"""A rank that ends while a gloo worker thread still holds Python state: aborts when Python finalizes, not without.

Rank 0 ends with a collective in flight on a subgroup that stays referenced (as a trained FSDP model keeps its
groups); rank 1 joins it late. When it completes, rank 0's gloo worker thread runs Python (a callback chained to the
collective) and needs the GIL, while rank 0's main thread is already finalizing the interpreter: the same path as a
worker that drops the last reference to a Python-owned tensor of the rank's final collective. Rank 1 is only the
peer: it always ends without finalization, so its own exit cannot race.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # launches processes

REPO = Path(__file__).resolve().parents[2]
RANK = """
import os, sys, time
import torch, torch.distributed as dist
from benchmarks.harness.process import exit_without_finalization
rank, ending = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", rank=rank, world_size=2)
group = dist.new_group([0, 1])
dist.barrier(group=group)  # both ends connected: rank 0 must not end while rank 1 still builds the group
tensor = torch.ones(1 << 16)
if rank == 0:  # the callback runs in gloo's worker thread once the collective completes, and takes the GIL
    dist.all_reduce(tensor, group=group, async_op=True).get_future().then(lambda f: f.value())
else:
    time.sleep(1)
    try:
        dist.all_reduce(tensor, group=group)
    except RuntimeError:
        pass  # rank 0 ended without finalization: its side of the collective is gone
if ending == "without_finalization" or rank == 1:  # rank 1 is the peer, not the subject: it never finalizes
    exit_without_finalization()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_zero_exit_code(ending: str) -> int:
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "PYTHONPATH": str(REPO)}
    ranks = [
        subprocess.Popen([sys.executable, "-c", RANK, str(rank), ending], env=env, stderr=stream)
        for rank, stream in ((0, subprocess.DEVNULL), (1, subprocess.PIPE))
    ]
    try:
        codes = [proc.wait(timeout=120) for proc in ranks]
    finally:
        for proc in ranks:
            proc.kill()
            proc.wait()
    peer_log = ranks[1].stderr.read().decode(errors="replace") if ranks[1].stderr else ""
    assert codes[1] == 0, f"the peer rank failed (exit {codes[1]}):\n{peer_log[-2000:]}"
    return codes[0]


@pytest.mark.timeout(180)
def test_a_rank_ending_without_finalization_exits_cleanly():
    assert _rank_zero_exit_code("without_finalization") == 0


@pytest.mark.skipif(sys.version_info >= (3, 14), reason="Python 3.14 no longer ends such threads with pthread_exit")
@pytest.mark.timeout(180)
def test_the_same_rank_aborts_when_python_finalizes_on_torch_2_13():
    """The hazard `exit_without_finalization` avoids, as each torch release the requirement admits shows it.

    torch 2.13 aborts every time (SIGABRT). torch 2.14 mostly exits cleanly (6 of 6 runs on an idle machine), but was
    seen to crash with SIGSEGV under the suite's load: still unsafe, so the harness keeps ending ranks without
    finalization, and this test accepts either outcome there.
    """
    import torch

    code = _rank_zero_exit_code("finalize")
    if tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 14):
        assert code == -6, f"torch {torch.__version__}"  # SIGABRT: "terminate called without an active exception"
    else:
        assert code in (0, -11), f"torch {torch.__version__}: exit code {code}"
