"""The federation mesh's life cycle in a real (one-rank gloo) process."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow  # launches processes

_SCRIPT = textwrap.dedent(
    """
    import atexit, sys
    import torch.distributed as dist
    from lightning_fedshard.core.transport.mesh import build_federation_mesh
    from lightning_fedshard.core.transport.topology import FederationTopology

    # Exit handlers run last-registered first: this one runs after the mesh's own.
    atexit.register(lambda: print(f"initialized at exit: {dist.is_initialized()}", flush=True))
    dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
    build_federation_mesh(FederationTopology(world_size=1, num_groups=1, shard_size=1), "cpu")
    """
)


def test_building_a_mesh_destroys_every_process_group_at_exit(tmp_path):
    """Gloo may abort a process at exit when its groups were never destroyed; Lightning only does it for NCCL."""
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(tmp_path / "store")], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "initialized at exit: False" in done.stdout, done.stdout + done.stderr[-2000:]
