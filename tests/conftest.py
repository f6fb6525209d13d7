"""Shared pytest set-up: what unit and integration tests both use.

Fixtures that start real processes (coordinator servers, PostgreSQL) are the integration tests'
own, in tests/integration/conftest.py.
"""

import sys
from pathlib import Path

import pytest

# Test modules import shared helpers as `tests.…`: make the repository root importable however
# pytest was started (`pytest`, `python -m pytest`, from another directory).
_REPO_ROOT = str(Path(__file__).resolve().parent.parent)
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

pytest_plugins = ["tests.fixtures.coordinator", "tests.fixtures.s3"]


@pytest.fixture
def single_thread():
    """One intra-op thread: torch's OpenMP workers spin at every op barrier, so a 2-thread run
    on 2 cores shared with another busy process (a benchmark, a parallel test) slows down tens
    of times. The models in these tests are too small to gain from a second thread anyway."""
    import torch  # here, not at the top: the coordinator's tests alone need not load it

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
