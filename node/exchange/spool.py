"""Packet bytes kept in files mapped into memory, not in the process's heap.

    spool = Spool(Path("~/.cache/locoswarm/spool").expanduser())
    data = spool.keep(payload)   # a read-only memoryview of an unnamed file holding the bytes

A node holds two rounds of packets whole: the round it applies, which it serves onward to its
peers, and the round before it, kept until its manifest is final (node/round/amend.py). For a 1B
model at 8 packets a round that is about 0.28 bytes per parameter, for DiLoCo's dense deltas 32;
it grows with the model and the number of peers. In the heap those bytes are memory the node
must have; in a file's pages they are page cache that the kernel writes out and reclaims when
memory is short, and reads back when a peer asks for them.

Each packet gets an unnamed temporary file in the spool directory (Linux's O_TMPFILE where the
file system has it): the mapping keeps it alive, and its disk space is freed when the last view
of it is dropped, so a crash leaves nothing behind. The directory must be on a disk: on a tmpfs
(often /tmp) the pages would be memory again. Readers get a memoryview, which compares equal to
the same bytes, slices without copying, and feeds hashlib, msgpack and the stream writers; code
that needs `bytes` copies it (`bytes(data)`), for as long as it needs it.
"""

from __future__ import annotations

import logging
import mmap
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)


MEMORY_FILE_SYSTEMS = frozenset({"tmpfs", "ramfs"})


def file_system_type(path: Path) -> str | None:
    """The type of the file system `path` lives on (the mount point in /proc/self/mounts that is its
    longest prefix), or None where that cannot be read."""
    path = path.resolve()
    best, kind = -1, None
    try:
        with open("/proc/self/mounts") as mounts:
            for line in mounts:
                fields = line.split()
                if len(fields) < 3:
                    continue
                mount_point = Path(fields[1].replace("\\040", " "))
                if (path == mount_point or mount_point in path.parents) and len(mount_point.parts) > best:
                    best, kind = len(mount_point.parts), fields[2]
    except OSError:
        return None
    return kind


class Spool:
    """Where a node keeps the packets it holds: files in `directory`, or the heap when None."""

    def __init__(self, directory: Path | None):
        self.directory = directory
        self._failing = False  # the last write failed (warned once until one succeeds)
        if directory is not None:
            try:
                directory.mkdir(parents=True, exist_ok=True)
                self._mapped(b"\0")  # fails here, at start-up, if the directory cannot hold files
            except OSError as e:
                log.warning("packets stay in memory: cannot keep them in %s (%s)", directory, e)
                self.directory = None
            else:
                if (kind := file_system_type(directory)) in MEMORY_FILE_SYSTEMS:
                    log.warning(
                        "the packet spool %s is on a %s, whose files are memory: set network.packet_spool_dir "
                        "(--packet-spool-dir) to a directory on a disk",
                        directory,
                        kind,
                    )

    def keep(self, data: bytes | bytearray | memoryview) -> bytes | memoryview:
        """`data` as it will be held: a read-only view of a mapped file holding a copy of it, or
        `bytes` in the heap without a directory, for empty data (which cannot be mapped), and when
        the file cannot be written (a full disk loses no packet)."""
        if self.directory is None or not len(data):
            return bytes(data)
        try:
            view = self._mapped(data)
        except OSError as e:
            if not self._failing:
                log.warning("keeping packets in memory while %s cannot hold them: %s", self.directory, e)
            self._failing = True
            return bytes(data)
        self._failing = False
        return view

    def _mapped(self, data) -> memoryview:
        with tempfile.TemporaryFile(dir=self.directory, prefix="packet-") as f:
            f.write(data)
            f.flush()
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)  # outlives the closed file
        return memoryview(mapped)
