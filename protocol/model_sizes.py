"""How many parameters a run's model has, for what needs the figure without building a model.

The coordinator never imports torch, yet its status reports each round's compression against
sending the pseudo-gradients dense: `dense_bytes(model, num_packets)`, 4 bytes (fp32) a parameter
a packet. A preset's count is `node.training.model.num_parameters(preset)` (a tied embedding
counted once); a run that sets `model.vocab_size` changes the embedding (vocab x hidden) and,
untied, the output head as much again. tests/unit/test_round_figures.py checks both against the
models themselves, for every preset of `protocol.run_config.ModelSection`.
"""

from __future__ import annotations

from dataclasses import dataclass

DENSE_BYTES_PER_PARAMETER = 4  # fp32


@dataclass(frozen=True, slots=True)
class PresetSize:
    num_parameters: int  # at the preset's own vocabulary
    vocab_size: int  # the preset's vocabulary
    hidden: int  # embedding width
    tied: bool  # the output head shares the embedding matrix

    def num_parameters_at(self, vocab_size: int | None) -> int:
        """The count with the embedding (and an untied head) resized to `vocab_size`."""
        if vocab_size is None:
            return self.num_parameters
        matrices = 1 if self.tied else 2
        return self.num_parameters + (vocab_size - self.vocab_size) * self.hidden * matrices


PRESET_SIZES: dict[str, PresetSize] = {
    "tiny": PresetSize(836_736, 256, 128, True),
    "mini": PresetSize(4_885_760, 256, 256, True),
    "small": PresetSize(10_720_128, 256, 384, True),
    "512m": PresetSize(512_398_848, 32_000, 1536, False),
    "1b": PresetSize(1_100_048_384, 32_000, 2048, False),
}


def num_parameters(preset: str, vocab_size: int | None = None) -> int | None:
    """Parameters of `preset` at `vocab_size` (None: the preset's own); None for an unknown preset."""
    size = PRESET_SIZES.get(preset)
    return None if size is None else size.num_parameters_at(vocab_size)


def dense_bytes(model, num_packets: int) -> int | None:
    """Bytes of `num_packets` pseudo-gradients of the run's `model` section (its preset and
    vocab_size) sent dense in fp32; None for an unknown preset."""
    count = num_parameters(model.preset, getattr(model, "vocab_size", None))
    return None if count is None else DENSE_BYTES_PER_PARAMETER * count * num_packets
