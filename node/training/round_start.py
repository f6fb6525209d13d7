"""A round's start, kept to be put back: what recomputing an amended round needs of the outer step.

    kept = outer.keep_start(prepared)   # before outer.commit(prepared)
    ...the round's manifest is amended...
    outer.restore_start(kept)           # parameters and outer state as they were; then commit again

An outer step `theta - aggregate` leaves every coordinate where the aggregate is zero exactly as it
was, so a SparseLoCo start is kept as the coordinates its step moves (`StartPatch`): a bit per
coordinate and an fp32 value for each moved one (about R x k/chunk of the model for R packets),
on the training device, restored from the start after the step. A tensor moved almost everywhere,
a multi-rank node's rows, or a DiLoCo start (dense: every coordinate moves) is a dense copy, and
DiLoCo's outer momentum is copied beside it (`RoundStart.outer_state`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# Above this share of a tensor's coordinates moved, a patch (1 bit per coordinate + 4 bytes per moved
# one) saves too little over a dense copy (4 bytes per coordinate) to be worth its restore.
MAX_PATCH_FRACTION = 0.75
_BIT_WEIGHTS = (128, 64, 32, 16, 8, 4, 2, 1)


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """A flat bool tensor as uint8, eight to a byte, first in the high bit (zero-padded)."""
    padded = torch.zeros((mask.numel() + 7) // 8 * 8, dtype=torch.uint8, device=mask.device)
    padded[: mask.numel()] = mask.reshape(-1)
    weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8, device=mask.device)
    return (padded.view(-1, 8) * weights).sum(1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, count: int) -> torch.Tensor:
    """Inverse of `pack_bits`: the first `count` bits as a flat bool tensor."""
    weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8, device=packed.device)
    return (packed.unsqueeze(1) & weights).bool().reshape(-1)[:count]


@dataclass(frozen=True, slots=True)
class StartPatch:
    """A round start kept as the coordinates its outer step changed: name -> (bitmask of the moved
    coordinates, their values before the step, in index order), or a dense copy where too much of
    the tensor moved. The patch lives on `device` (the training device: the host then holds only
    the round start and the error buffer); dense copies stay beside the start."""

    coordinates: dict[str, tuple[torch.Tensor, torch.Tensor]]
    dense: dict[str, torch.Tensor]

    @classmethod
    def before(
        cls,
        start: dict[str, torch.Tensor],
        aggregates: dict[str, torch.Tensor] | None,
        device: torch.device | str | None = None,
    ) -> StartPatch:
        """What `start` holds where `aggregates` is non-zero (nothing moves where it is zero: x - 0 == x)."""
        coordinates, dense = {}, {}
        for name, value in start.items():
            if aggregates is None:
                continue  # no aggregate: the outer step changes nothing
            aggregate = aggregates[name]
            if aggregate.numel() != value.numel():  # a multi-rank node's rank 0 holds its own rows only
                dense[name] = value.clone()
                continue
            moved = aggregate.reshape(-1) != 0
            index = moved.nonzero().squeeze(1).to(value.device)  # (M,), ascending
            if index.numel() > MAX_PATCH_FRACTION * value.numel():
                dense[name] = value.clone()
                continue
            target = device if device is not None else value.device
            coordinates[name] = (pack_bits(moved).to(target), value.reshape(-1)[index].to(target))
        return cls(coordinates, dense)

    @classmethod
    def copy_of(cls, start: dict[str, torch.Tensor]) -> StartPatch:
        """Every tensor of `start` kept dense (a step that moves every coordinate: DiLoCo's)."""
        return cls({}, {name: value.clone() for name, value in start.items()})

    def restored(self, name: str, after: torch.Tensor) -> torch.Tensor:
        """Tensor `name` before the step, from the same tensor after it (`after` is not changed)."""
        if name in self.dense:
            return self.dense[name]
        before = after.clone()
        if name in self.coordinates:
            bits, values = self.coordinates[name]
            moved = unpack_bits(bits.to(after.device), after.numel())
            before.view(-1)[moved] = values.to(after.device)  # boolean index: ascending order, as kept
        return before

    @property
    def num_bytes(self) -> int:
        return sum(b.nbytes + v.nbytes for b, v in self.coordinates.values()) + sum(
            t.nbytes for t in self.dense.values()
        )


@dataclass(frozen=True, slots=True)
class RoundStart:
    """What `OuterStep.keep_start` keeps: the global model before the step, and the outer state that
    the step changes (DiLoCo's momentum; {} for SparseLoCo, whose error buffers the step leaves alone)."""

    params: StartPatch
    outer_state: dict[str, torch.Tensor] = field(default_factory=dict)
