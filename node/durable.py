"""Files that survive a crash: written, fsynced, and made visible by a rename whose directory is
fsynced too. Checkpoints (node/training/checkpoint.py) and a node's own packets
(node/round/own_packets.py) are written this way."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path


def write_synced(path: Path, write: Callable[[Path], object]) -> None:
    """`write(path)`, then its bytes forced to the disk."""
    write(path)
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def replace_synced(path: Path, data: bytes) -> None:
    """`path` holds `data` or what it held before, whenever the process dies: written beside it,
    fsynced, renamed over it (the caller fsyncs the directory, once for several files)."""
    staging = path.with_name(f".{path.name}.tmp")
    write_synced(staging, lambda p: p.write_bytes(data))
    os.replace(staging, path)


def fsync_dir(path: Path) -> None:
    """Make the renames and new names in directory `path` durable (POSIX; a no-op elsewhere)."""
    if os.name == "posix":
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
