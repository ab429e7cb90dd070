"""Byte sizes as people write them in configs and on command lines: "512MiB", "1.5GB", 4096."""

from __future__ import annotations

import re
from fractions import Fraction

UNITS = {
    "": 1, "b": 1,
    "k": 1 << 10, "kib": 1 << 10, "kb": 10**3,
    "m": 1 << 20, "mib": 1 << 20, "mb": 10**6,
    "g": 1 << 30, "gib": 1 << 30, "gb": 10**9,
    "t": 1 << 40, "tib": 1 << 40, "tb": 10**12,
}
_PATTERN = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | str) -> int:
    """Bytes in `value`: an int, or a number with a unit (KiB/MiB/GiB/TiB binary,
    KB/MB/GB/TB decimal, K/M/G/T binary). Raises ValueError saying what is accepted."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a size")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{value} is negative")
        return value
    if not isinstance(value, str):
        raise ValueError(f"{value!r} is not a size (an int or a string like '512MiB')")
    m = _PATTERN.match(value)
    unit = m.group(2).lower() if m else None
    if not m or unit not in UNITS:
        raise ValueError(f"{value!r} is not a size; write e.g. 4096, '512MiB', '2GiB' or '1.5GB'")
    number = Fraction(m.group(1)) * UNITS[unit]  # exact: no float rounding of big sizes
    if number.denominator != 1:
        raise ValueError(f"{value!r} is not a whole number of bytes")
    return int(number)


def format_size(nbytes: float) -> str:
    """Short binary form for tables and messages: 1536 -> '1.5 KiB'."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(nbytes) >= scale:
            text = f"{nbytes / scale:.2f}".rstrip("0").rstrip(".")
            return f"{text} {unit}"
    return f"{int(nbytes)} B"


def yaml_size(nbytes: int) -> str:
    """Exact form for writing back into a YAML config: 1048576 -> '1MiB'."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return str(nbytes)


COUNT_SCALE = {"K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}


def parse_count(text: str) -> int:
    """Parameter counts as people write them: '1B' -> 10**9, '250M', '1.5B', '4096'; K, M, B
    (or G), T are powers of 1000. Raises ValueError saying what is accepted."""
    t = str(text).strip().upper()
    try:
        n = float(t[:-1]) * COUNT_SCALE[t[-1]] if t and t[-1] in COUNT_SCALE else float(t)
    except ValueError:
        raise ValueError(f"{text!r} is not a count (e.g. 50M, 1.5B)") from None
    if n < 1 or n != int(n):
        raise ValueError(f"{text!r} must be a positive whole count")
    return int(n)


def format_count(n: int) -> str:
    """The shortest exact spelling parse_count reads back: 10**9 -> '1B', 6_000_000 -> '6M'."""
    for suffix in ("B", "M", "K"):
        if n % COUNT_SCALE[suffix] == 0:
            return f"{n // COUNT_SCALE[suffix]}{suffix}"
    return str(n)
