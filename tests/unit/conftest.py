"""Fixtures shared by the unit tests."""

import pytest
import torch


@pytest.fixture
def single_thread():
    """One intra-op thread: torch's OpenMP workers spin at every op barrier, so a 2-thread run
    on 2 cores shared with another busy process (a benchmark, a parallel test) slows down tens
    of times. The models in these tests are too small to gain from a second thread anyway."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
