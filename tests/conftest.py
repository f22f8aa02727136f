import os

import pytest
import torch.distributed as dist

# Tests never reach a model hub, and each rank gets one thread (several ranks share 2 cores).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(autouse=True)
def _no_leaked_process_group():
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
