"""Which errors count as a failed collective: by type and origin, never by the words of the message."""

from __future__ import annotations

import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lightning_fedshard.checkpoint import (
    FederationPeerError,
    collective_failures,
    is_peer_failure,
    peer_failure_message,
    unsafe_to_save,
)
from lightning_fedshard.core.step.nonfinite import NonFiniteOuterGradientError
from tests.launch import free_port

WORDS = "timeout reading shard from gloo nccl: connection closed by peer, connection reset, broken pipe, timed out"


def _raised(error: BaseException) -> BaseException:
    try:
        raise error
    except BaseException as caught:
        return caught


def test_a_user_error_with_the_words_of_a_collective_failure_is_not_one():
    for error in (RuntimeError(WORDS), _raised(RuntimeError(WORDS)), _raised(TimeoutError(WORDS))):
        assert not is_peer_failure(error)
        assert unsafe_to_save(error) is None
    assert not is_peer_failure(None) and unsafe_to_save(None) is None


TORCH_ERRORS = [dist.DistError, dist.DistBackendError, dist.DistNetworkError, dist.DistStoreError, dist.QueueEmptyError]


@pytest.mark.parametrize("error_type", TORCH_ERRORS)
def test_torch_distributed_errors_are_peer_failures(error_type):
    error = error_type("whatever the text")
    assert is_peer_failure(error)
    assert "peer rank" in unsafe_to_save(error)


def test_collective_failures_types_what_fails_inside_and_nothing_else():
    with pytest.raises(FederationPeerError, match="Collective 'barrier' failed: boom") as failure:
        with collective_failures("barrier"):
            raise RuntimeError("boom")
    assert type(failure.value.__cause__) is RuntimeError and is_peer_failure(failure.value)
    assert isinstance(failure.value, RuntimeError)  # still caught by handlers of the original gloo error
    with pytest.raises(FederationPeerError, match="Collective 'inner' failed") as nested:
        with collective_failures("outer"), collective_failures("inner"):
            raise RuntimeError("boom")
    assert type(nested.value.__cause__) is RuntimeError  # typed once, by the innermost block
    with pytest.raises(ValueError), collective_failures("barrier"):
        raise ValueError("not a collective failure")


def test_the_cause_and_context_chain_is_searched():
    def fail() -> None:
        raise dist.DistNetworkError("peer gone")

    try:
        try:
            fail()
        except RuntimeError as error:
            raise ValueError("while handling") from error
    except ValueError as caused:
        assert is_peer_failure(caused)
    try:
        try:
            fail()
        except RuntimeError:
            raise KeyError("raised in the handler") from None
    except KeyError as hidden:  # `from None` only hides the context from tracebacks
        assert is_peer_failure(hidden)
    try:
        try:
            raise RuntimeError(WORDS)
        except RuntimeError as error:
            raise ValueError("while handling") from error
    except ValueError as user:
        assert not is_peer_failure(user)


def test_no_save_while_handling_a_failed_sync_or_a_dead_peer():
    assert "non-finite" in unsafe_to_save(NonFiniteOuterGradientError([1], 2, 7))
    dead = FederationPeerError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1234")
    assert is_peer_failure(dead) and "peer rank" in unsafe_to_save(dead)
    assert unsafe_to_save(ValueError("user bug")) is None


def test_peer_failure_message_names_the_rank_and_the_error():
    message = peer_failure_message(dist.DistNetworkError("x"), rank=3)
    assert message.startswith("lightning_fedshard: rank 3 stopped because a collective failed (DistNetworkError)")
    assert "Checkpoints already on disk are intact" in message


_PEER = """
import sys, time
from datetime import timedelta
from pathlib import Path
import torch.distributed as dist
dist.init_process_group("gloo", init_method=sys.argv[1], rank=1, world_size=2, timeout=timedelta(seconds=60))
dist.new_group([0, 1], timeout=timedelta(seconds=1))
dist.barrier()
while not Path(sys.argv[2]).exists():  # silent until the other rank's collective has timed out
    time.sleep(0.05)
"""


@pytest.mark.slow
def test_real_gloo_failures_are_plain_runtime_errors_and_count_by_origin(tmp_path: Path):
    """A silent peer (timeout) and a dead peer, as torch 2.13 reports them on gloo."""
    init, release = f"tcp://127.0.0.1:{free_port()}", tmp_path / "release"
    peer = subprocess.Popen([sys.executable, "-c", _PEER, init, str(release)])
    try:
        # A long timeout to start (the peer imports torch on a busy machine), a short one for the collective.
        dist.init_process_group("gloo", init_method=init, rank=0, world_size=2, timeout=timedelta(seconds=60))
        short = dist.new_group([0, 1], timeout=timedelta(seconds=1))
        dist.barrier()
        with pytest.raises(RuntimeError, match="Timed out") as timeout:
            dist.all_reduce(torch.ones(2), group=short)
        release.touch()
        assert peer.wait(timeout=30) == 0
        time.sleep(0.2)
        with pytest.raises(RuntimeError) as dead:
            dist.barrier()
    finally:
        release.touch()
        peer.wait(timeout=30)
    for failure in (timeout.value, dead.value):
        assert type(failure) is RuntimeError  # no DistError subclass: only the origin tells
        assert is_peer_failure(failure), str(failure)
    # the same text, raised by user code, is an ordinary error
    assert not is_peer_failure(_raised(RuntimeError(str(dead.value))))
