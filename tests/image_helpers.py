"""Shared by the image tests: the planted 'image rows one position late' fault, in process."""

from ouro.engine.multimodal import ImageInputs


def rows_one_position_late(monkeypatch) -> None:
    """Every image row of a chunk written one position after its image token (dropped at the chunk's end)."""
    real = ImageInputs.chunk_rows

    def late(self, start, n):
        offsets, rows = real(self, start, n)
        keep = [(o + 1, r) for o, r in zip(offsets, rows) if o + 1 < n]
        return [o for o, _ in keep], [r for _, r in keep]
    monkeypatch.setattr(ImageInputs, "chunk_rows", late)
