"""Byte sizes: the binary units, and sizes as people read and write them.

One place for both directions, so that a log line, `nbdist doctor` and `nbdist bench`
print a size the same way and a size printed can be typed back (`1.5 MiB`, `256K`).
"""
from __future__ import annotations

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

_UNITS = (("GiB", GiB), ("MiB", MiB), ("KiB", KiB))


def format_bytes(n: int) -> str:
    """`n` in the largest unit it reaches: 512 B, 16 KiB, 1.5 MiB, 2 GiB."""
    for unit, scale in _UNITS:
        if n >= scale:
            return f"{n / scale:g} {unit}"
    return f"{n} B"


def parse_bytes(text: str) -> int:
    """A size as written on a command line: 4096, 4K, 4KiB, 1.5M, 2 GiB (case ignored)."""
    given = text
    text = text.strip().upper().replace(" ", "")
    text = text[:-1] if text.endswith("B") else text
    text = text[:-1] if text.endswith("I") else text
    scale = {"K": KiB, "M": MiB, "G": GiB}.get(text[-1:], 1)
    try:
        value = float(text[:-1] if scale > 1 else text)
    except ValueError:
        raise ValueError(f"not a size in bytes: {given!r} (e.g. 4096, 64K, 1.5M, 2GiB)") from None
    if value < 0:
        raise ValueError(f"a size in bytes cannot be negative: {given!r}")
    return int(value * scale)
