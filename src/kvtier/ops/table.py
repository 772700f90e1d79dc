"""Plain-text tables and human-readable sizes and ages for the CLI and the benchmarks."""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from typing import Any, TextIO

Column = tuple[str, str, str]  # (row key, heading, format spec)

# C0 and C1 controls (ESC, CR, BS, ...) and the Unicode direction overrides: text from a store,
# a worker or a log must never move the cursor, clear the screen or reorder what is shown.
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def printable(text: str, keep_newlines: bool = False) -> str:
    """``text`` with every control character written as an escape (``\x1b``, ``\u202e``)."""

    def escape(match: re.Match) -> str:
        c = match.group()
        if keep_newlines and c == "\n":
            return c
        return f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}"

    return _UNPRINTABLE.sub(escape, text)


def _cell(value: Any, fmt: str) -> str:
    return "" if value is None else printable(format(value, fmt))


def render(rows: Sequence[dict[str, Any]], columns: Sequence[Column]) -> list[str]:
    """The lines of a table (heading, rule, one line per row): text left, numbers right; a
    row without a column's value (or None) leaves that cell empty. Cells are ``printable``: a
    table never carries control characters to the terminal."""
    cells = [[_cell(row.get(key), fmt) for key, _, fmt in columns] for row in rows]
    headings = [heading for _, heading, _ in columns]
    widths = [
        max(len(h), *(len(c[i]) for c in cells)) if cells else len(h)
        for i, h in enumerate(headings)
    ]
    left = [fmt.endswith("s") for _, _, fmt in columns]

    def join(values: Sequence[str]) -> str:
        padded = (v.ljust(w) if lj else v.rjust(w) for v, w, lj in zip(values, widths, left))
        return "  ".join(padded).rstrip()

    line = join(headings)
    return [line, "-" * len(line), *(join(c) for c in cells)]


def print_table(
    rows: Sequence[dict[str, Any]], columns: Sequence[Column], file: TextIO | None = None
) -> None:
    out = file or sys.stdout
    for line in render(rows, columns):
        print(line, file=out)
    out.flush()


def size(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def age(seconds: float) -> str:
    """90 -> '1m30s'; the two largest units."""
    seconds = max(0, int(seconds))
    parts: list[str] = []
    for unit, length in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if seconds >= length or (unit == "s" and not parts):
            parts.append(f"{seconds // length}{unit}")
            seconds %= length
        if len(parts) == 2:
            break
    return "".join(parts)


_SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_size(text: str) -> int:
    """'500M', '10G', '1.5T', '4096' -> bytes (binary units; a trailing 'iB' or 'B' is fine)."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = t[-1:] if t[-1:] in _SIZE_UNITS and t[-1:] else ""
    number = t[: len(t) - len(unit)]
    try:
        value = float(number)
    except ValueError:
        raise ValueError(f"{text!r} is not a size such as 500M, 10G or 4096") from None
    if value < 0:
        raise ValueError(f"{text!r}: a size cannot be negative")
    return int(value * _SIZE_UNITS[unit])


def parse_duration(text: str) -> float:
    """'90s', '30m', '12h', '7d', '2w', '45' (seconds) -> seconds."""
    t = text.strip().lower()
    unit = t[-1:] if t[-1:] in _DURATION_UNITS else "s"
    number = t[:-1] if t[-1:] in _DURATION_UNITS else t
    try:
        value = float(number)
    except ValueError:
        raise ValueError(f"{text!r} is not a duration such as 90s, 30m, 12h or 7d") from None
    if value < 0:
        raise ValueError(f"{text!r}: a duration cannot be negative")
    return value * _DURATION_UNITS[unit]


def plural(n: int, word: str) -> str:
    """plural(1, 'user') -> '1 user'; plural(2, 'user') -> '2 users'."""
    return f"{n:,} {word}{'' if n == 1 else 's'}"
