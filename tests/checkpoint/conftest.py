import pytest

from tests.checkpoint.one_rank import Rank, start_one_rank


@pytest.fixture
def rank() -> Rank:
    return start_one_rank()
