"""Shared pytest set-up. Each part keeps its fixtures in its own module, loaded here."""

import sys
from pathlib import Path

# Test modules import shared helpers as `tests.…`: make the repository root importable however
# pytest was started (`pytest`, `python -m pytest`, from another directory).
_REPO_ROOT = str(Path(__file__).resolve().parent.parent)
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

pytest_plugins = ["tests.integration.conftest_coordinator"]
