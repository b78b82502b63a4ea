"""Byte-size strings: ``"6GiB"``, ``"500MB"``, ``1024``."""
from __future__ import annotations

import math
import re
from decimal import Decimal

from dtr.errors import BudgetError

__all__ = ["parse_bytes", "format_bytes", "MAX_BYTES"]

_UNITS = {
    "": 1, "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")

#: The largest size the core can hold (its counters are signed 64-bit integers).
MAX_BYTES = 2**63 - 1

_FORMS = "use bytes, or a number with KiB/MiB/GiB (1024-based) or KB/MB/GB (1000-based)"


def _checked(n: int, text: object) -> int:
    if n > MAX_BYTES:
        raise BudgetError(f"size {text} is too large: at most {MAX_BYTES} bytes (2^63 - 1)")
    return n


def parse_bytes(value: int | float | str) -> int:
    """Parse a size in bytes.

    Args:
        value: an int (bytes), a float holding a whole number of bytes, or a
            string: a whole number of bytes, or a number with a unit,
            ``KiB/MiB/GiB/TiB`` (powers of 1024) or ``KB/MB/GB/TB`` (powers of
            1000), e.g. ``"1.5GiB"``.

    Returns:
        The size in whole bytes (a number with a unit is rounded down).

    Raises:
        BudgetError: the value is negative, not a size, a fraction of a byte
            without a unit (``"0.4"``: a ratio was probably meant), infinite,
            or more than :data:`MAX_BYTES`.
    """
    if isinstance(value, bool):
        raise BudgetError(f"not a size: {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise BudgetError(f"a size cannot be negative: {value}")
        return _checked(value, value)
    if isinstance(value, float):
        if not math.isfinite(value) or value < 0:
            raise BudgetError(f"not a valid size: {value}")
        if value != math.floor(value):
            raise BudgetError(f"not a whole number of bytes: {value!r}")
        return _checked(int(value), repr(value))
    m = _PATTERN.match(str(value))
    if not m or m.group(2).upper() not in _UNITS:
        raise BudgetError(f"not a size: {value!r} ({_FORMS})")
    try:
        number = Decimal(m.group(1))  # exact: a float would round 2**63 and large byte counts
        exact = number * _UNITS[m.group(2).upper()]
        too_large = exact > MAX_BYTES
    except ArithmeticError:  # past Decimal's exponent range
        too_large = True
    if too_large:
        raise BudgetError(f"size {str(value).strip()!r} is too large: at most {MAX_BYTES} bytes (2^63 - 1)")
    whole = int(exact)
    if not m.group(2) and exact != whole:
        raise BudgetError(f"not a whole number of bytes: {value!r} (bytes are whole; for a fraction of a "
                          f"larger unit write e.g. 1.5GiB)")
    return whole


def format_bytes(n: float) -> str:
    """Format a byte count for people: ``format_bytes(3 * 2**30) == '3.00 GiB'``."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"
