"""Quantities as an operator reads them: a byte count in the unit that fits it (25 MiB, not 0.0 GiB)."""

from __future__ import annotations

BYTE_UNITS = ("bytes", "KiB", "MiB", "GiB", "TiB")


def byte_size(n: float) -> str:
    for unit in BYTE_UNITS[:-1]:
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} {BYTE_UNITS[-1]}"
