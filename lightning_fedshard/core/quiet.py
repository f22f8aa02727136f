"""torch's warnings about choices this package makes itself, silenced where it makes them.

Each filter names one message that torch emits on every rank for something the user did not choose and cannot
change: FSDP1's ``NO_SHARD`` for one-rank shards (FL+HSDP with ``shard_size=1``, or one-rank groups), FSDP1's
``ShardedTensor`` state dicts behind sharded checkpoints, and the process-group device lookups inside them. The
filters apply only inside :func:`torch_choices_silenced`, so the same warnings still reach users who call torch
directly.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager

#: (message regex, category) of each silenced warning.
_SILENCED: tuple[tuple[str, type[Warning]], ...] = (
    (r"The `NO_SHARD` sharding strategy is deprecated", FutureWarning),
    (r"FSDP is switching to use `NO_SHARD`", UserWarning),
    # torch 2.13 writes "willbe"; earlier versions "will be"
    (r"When using ``NO_SHARD`` for ``ShardingStrategy``, full_state_dict will ?be returned", UserWarning),
    (r"Please use DTensor instead and we are deprecating ShardedTensor", FutureWarning),
    (r"`_get_pg_default_device` will be deprecated", UserWarning),
    (r"Multiple backends are registered with this ProcessGroup", UserWarning),
)


@contextmanager
def torch_choices_silenced() -> Iterator[None]:
    """Within the block, drop torch's warnings about the sharding and state-dict choices this package makes."""
    with warnings.catch_warnings():
        for message, category in _SILENCED:
            warnings.filterwarnings("ignore", message=message, category=category)
        yield
