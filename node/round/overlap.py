"""The one-round-delayed outer step, written once for the node and the simulator.

Without overlap, round r's exchange lands right after round r's training. With overlap (the run
option outer.overlap: a node trains round r+1 while round r's packets are still moving), round
r's exchange is put in flight after its training and lands after round r+1's training, on top of
the parameters round r+1 started from. The error feedback still folds rounds in order; only the outer step is
one round late.

    pipeline = Pipeline(overlap)
    for r in rounds:
        train(r)
        landed = pipeline.land(r, exchange_of(r))   # (round, what to apply) or None
        if landed: apply(*landed)
    if (last := pipeline.drain()): apply(*last)    # before leaving or evaluating

What is in flight is opaque here: payload bytes in the simulator, an asyncio task in the node.
"""

from __future__ import annotations

from typing import Generic, TypeVar

T = TypeVar("T")


class Pipeline(Generic[T]):
    """Which round's exchange lands after a round's training: the round itself, or the one before."""

    def __init__(self, overlap: bool):
        self.overlap = overlap
        self._in_flight: tuple[int, T] | None = None

    @property
    def in_flight(self) -> tuple[int, T] | None:
        return self._in_flight

    def land(self, round: int, exchange: T) -> tuple[int, T] | None:
        """Round `round` trained and its exchange started: what lands now (None: nothing yet)."""
        if not self.overlap:
            return round, exchange
        landed, self._in_flight = self._in_flight, (round, exchange)
        return landed

    def drain(self) -> tuple[int, T] | None:
        """What is still in flight, taken out (the last round, before leaving)."""
        landed, self._in_flight = self._in_flight, None
        return landed
