"""Human-readable sizes and durations, as plans, summaries, drawings and error messages print them.

>>> human_bytes(1536), human_bytes(100), human_time(0.0042)
('1.50 KiB', '100 B', '4.20 ms')
"""
from __future__ import annotations

__all__ = ["human_bytes", "human_time"]


def human_bytes(n: float) -> str:
    """``n`` bytes in binary units: whole bytes below 1 KiB, two decimals above, TiB at most."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def human_time(seconds: float) -> str:
    """``seconds`` as s, ms or us, whichever keeps the number at 1 or more (us below a millisecond)."""
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.1f} us"
