"""Byte-size strings: ``"6GiB"``, ``"500MB"``, ``1024``."""
from __future__ import annotations

import re

from dtr.errors import BudgetError

__all__ = ["parse_bytes", "format_bytes"]

_UNITS = {
    "": 1, "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_bytes(value: int | str) -> int:
    """Parse a size in bytes.

    Args:
        value: an int (bytes) or a string: a number with an optional unit,
            ``KiB/MiB/GiB/TiB`` (powers of 1024) or ``KB/MB/GB/TB`` (powers of 1000).

    Returns:
        The size in whole bytes (rounded down).

    Raises:
        BudgetError: the value is negative or not a size.
    """
    if isinstance(value, bool):
        raise BudgetError(f"not a size: {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise BudgetError(f"a size cannot be negative: {value}")
        return value
    if isinstance(value, float):
        if value < 0 or value != value:
            raise BudgetError(f"not a valid size: {value}")
        return int(value)
    m = _PATTERN.match(str(value))
    if not m or m.group(2).upper() not in _UNITS:
        raise BudgetError(
            f"not a size: {value!r} (use bytes, or a number with KiB/MiB/GiB (1024-based) or KB/MB/GB (1000-based))")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def format_bytes(n: float) -> str:
    """Format a byte count for people: ``format_bytes(3 * 2**30) == '3.00 GiB'``."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"
