"""Human units at the edges, SI inside: parse sizes and runtimes, format them back."""

from __future__ import annotations

import math
import re

from .errors import PoetError

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
    "k": 1000,
    "m": 1000**2,
    "g": 1000**3,
}

_NUMBER = r"([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)"
_SIZE_RE = re.compile(rf"^\s*{_NUMBER}\s*([a-zA-Z]*)\s*$")
_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "min": 60.0, "h": 3600.0}


def parse_size(text: str | int | float, *, field: str = "size") -> int:
    """'1.5MB' -> 1500000, '256KiB' -> 262144, 4096 -> 4096. Decimal units are powers of 1000."""
    if isinstance(text, bool):
        raise PoetError(f"expected a size such as 1.5MB or 256KiB, got {text!r}", field=field)
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        match = _SIZE_RE.match(str(text))
        if not match:
            raise PoetError(f"cannot read {text!r} as a size; write e.g. 1.5MB, 256KiB or 4096B", field=field)
        number, unit = match.groups()
        if unit.lower() not in _SIZE_UNITS:
            raise PoetError(
                f"unknown size unit {unit!r} in {text!r}; use B, KB, KiB, MB, MiB, GB or GiB", field=field
            )
        value = float(number) * _SIZE_UNITS[unit.lower()]
    if not math.isfinite(value) or value <= 0:
        raise PoetError(f"must be a positive size, got {text!r}", field=field)
    return int(round(value))


def parse_runtime(text: str | float, plain_runtime_s: float, *, field: str = "runtime") -> float:
    """'1.2x' -> 1.2 * plain training runtime; '2.5s', '300ms' -> seconds."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        seconds = float(text)
    else:
        raw = str(text).strip().lower()
        match = re.match(rf"^{_NUMBER}\s*([a-z]*)$", raw)
        if not match:
            raise PoetError(
                f"cannot read {text!r} as a runtime; write a multiple of plain training such as 1.2x, "
                "or a time such as 2.5s or 300ms",
                field=field,
            )
        number, unit = float(match.group(1)), match.group(2)
        if unit == "x":
            seconds = number * plain_runtime_s
        elif unit in _TIME_UNITS:
            seconds = number * _TIME_UNITS[unit]
        elif unit == "":
            raise PoetError(f"{text!r} has no unit; write 1.2x (times plain training) or 2.5s", field=field)
        else:
            raise PoetError(f"unknown runtime unit {unit!r} in {text!r}; use x, s, ms or us", field=field)
    if not math.isfinite(seconds) or seconds <= 0:
        raise PoetError(f"must be positive, got {text!r}", field=field)
    return seconds


def format_bytes(n: float, *, binary: bool = False) -> str:
    """1536000 -> '1.54 MB' (or '1.46 MiB' with binary=True)."""
    base, units = (1024.0, ["B", "KiB", "MiB", "GiB", "TiB"]) if binary else (1000.0, ["B", "KB", "MB", "GB", "TB"])
    value = float(n)
    for unit in units:
        if abs(value) < base or unit == units[-1]:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.3g} {unit}"
        value /= base
    raise AssertionError("unreachable")


def format_seconds(s: float) -> str:
    if s >= 1:
        return f"{s:.3g} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} us"


def format_joules(j: float) -> str:
    if j >= 1:
        return f"{j:.4g} J"
    if j >= 1e-3:
        return f"{j * 1e3:.4g} mJ"
    return f"{j * 1e6:.4g} uJ"
