"""Failure policy: which exceptions mean that a collective failed, and when a checkpoint must not be written.

A failed collective (a peer rank died, or stopped answering within the timeout) is told apart from every other error
by its type and its origin, never by the words of its message:

* **type**: torch's own :class:`torch.distributed.DistError` subclasses (``DistBackendError``, ``DistNetworkError``,
  ``DistStoreError``, ...), and :class:`FederationPeerError`, which :func:`collective_failures` raises for a
  collective called by this package;
* **origin**: on gloo (torch 2.13) a dead peer ("Connection closed by peer") and a collective timeout ("Timed out
  waiting ... for recv operation") are plain ``RuntimeError``. Such an error counts when it was raised inside
  ``torch.distributed``'s c10d module while it waited on the work handle of a collective (FSDP's own all-gathers,
  Lightning's broadcasts).

The whole ``__cause__`` / ``__context__`` chain is searched, so an error raised while handling a failed collective
counts too. A ``RuntimeError("timeout reading shard")`` raised by user code is an ordinary error.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import TracebackType

import torch.distributed as dist

from lightning_fedshard.core.step.nonfinite import NonFiniteOuterGradientError

# torch raises the failures of its collectives from this module (the `wait()` on a collective's work handle).
_C10D_MODULE = "torch.distributed.distributed_c10d"


class FederationPeerError(RuntimeError):
    """A collective called by lightning_fedshard failed: a peer rank probably died or stopped answering.

    Raised by :func:`collective_failures` from the original error (its ``__cause__``). A ``RuntimeError``, so code that
    handled the original gloo error keeps working.
    """


@contextmanager
def collective_failures(operation: str) -> Iterator[None]:
    """Within the block, re-raise a failed collective as :class:`FederationPeerError`.

    Wrap only communication (``dist.barrier()``, ``dist.gather_object(...)``, an outer all-reduce), never code that
    may raise errors of its own: every ``RuntimeError`` raised inside is taken for a failed collective.

    Args:
        operation: What the block does, for the message (e.g. ``"barrier after a checkpoint save"``).

    Raises:
        FederationPeerError: From the ``RuntimeError`` raised inside the block.
    """
    try:
        yield
    except FederationPeerError:
        raise
    except RuntimeError as error:
        raise FederationPeerError(f"Collective {operation!r} failed: {error}") from error


def is_peer_failure(exception: BaseException | None) -> bool:
    """Whether ``exception`` (or one in its cause/context chain) is a failed collective; see the module docstring."""
    return any(_is_failed_collective(e) for e in _chain(exception))


def unsafe_to_save(exception: BaseException | None) -> str | None:
    """Why no checkpoint may be written while ``exception`` is being handled (e.g. by ``OnExceptionCheckpoint``).

    Returns:
        The reason, or ``None`` when saving is fine.
    """
    if isinstance(exception, NonFiniteOuterGradientError):
        return (
            "the federation stopped on a non-finite outer gradient; a checkpoint now would store the broken group"
            " weights, so the last checkpoint is kept as it is."
        )
    if is_peer_failure(exception):
        return "a collective failed (a peer rank probably died), so a save could not complete."
    return None


def peer_failure_message(exception: BaseException, rank: int) -> str:
    """What to tell the user when this rank stopped because a collective failed."""
    return (
        f"lightning_fedshard: rank {rank} stopped because a collective failed ({type(exception).__name__}): a peer"
        " rank probably died or stopped answering within the strategy's `timeout`. Checkpoints already on disk are"
        " intact (saves are written to a temporary path and renamed when complete). Restart the job and resume with"
        " `trainer.fit(..., ckpt_path=<last checkpoint>)`."
    )


def _chain(exception: BaseException | None) -> Iterator[BaseException]:
    seen: set[int] = set()
    while exception is not None and id(exception) not in seen:
        seen.add(id(exception))
        yield exception
        exception = exception.__cause__ or exception.__context__


def _is_failed_collective(exception: BaseException) -> bool:
    if isinstance(exception, FederationPeerError):
        return True
    if not dist.is_available():
        return False
    if isinstance(exception, dist.DistError):
        return True
    return isinstance(exception, RuntimeError) and _raised_waiting_on_collective(exception.__traceback__)


def _raised_waiting_on_collective(traceback: TracebackType | None) -> bool:
    if traceback is None:
        return False  # never raised
    while traceback.tb_next is not None:
        traceback = traceback.tb_next
    frame = traceback.tb_frame
    if frame.f_globals.get("__name__") != _C10D_MODULE:
        return False
    # A collective's work handle in the raising frame: the failure came from the communication itself, not from
    # c10d's argument checks ("Default process group has not been initialized", a wrong tensor list, ...).
    return any(isinstance(value, dist.Work) for value in frame.f_locals.values())
