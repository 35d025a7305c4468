import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    """Tests are tiny: one intra-op thread is fastest and keeps runs deterministic."""
    torch.set_num_threads(1)
    yield
