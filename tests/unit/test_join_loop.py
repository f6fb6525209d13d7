"""The node's own event loop (node/cli/join.py `run_until_stopped`): what a stopped node leaves behind."""

from __future__ import annotations

import asyncio
import gc
import logging

import pytest

from node.cli.join import run_until_stopped

pytestmark = pytest.mark.timeout(30)


class LeavesATaskBehind:
    """A node whose run returns while a task it started still waits, as a node's background
    waits do when its rounds end (a fetch's wake-ups, a push retrying)."""

    reports = ["round 0"]

    def __init__(self) -> None:
        self.ended: list[str] = []
        self._tasks: set[asyncio.Task] = set()

    def stop(self) -> None:
        pass

    async def run(self) -> list[str]:
        async def waits_forever() -> None:
            try:
                await asyncio.Event().wait()
            finally:
                self.ended.append("cancelled")

        self._tasks.add(asyncio.get_running_loop().create_task(waits_forever()))
        await asyncio.sleep(0)
        return self.reports


def test_a_stopped_node_cancels_what_it_left_running_and_logs_no_destroyed_task(caplog):
    node = LeavesATaskBehind()
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        assert run_until_stopped(node) == (["round 0"], False)
        node._tasks.clear()  # the last reference: a task still pending would be destroyed here
        gc.collect()
    assert node.ended == ["cancelled"], "the leftover task was cancelled and ran its finally"
    assert not [r for r in caplog.records if "destroyed" in r.getMessage()]
