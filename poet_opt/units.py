"""Human units at the edges, SI inside: parse sizes and runtimes, format them back."""

from __future__ import annotations

import math
import re
import sys

from poet_opt.errors import PoetError, shown

# Sane limits for numbers read from files and flags: far beyond any real training step, close
# enough that sums and products over a whole graph stay finite (no inf, no OverflowError) in
# floats and in 64-bit integer arrays.
MAX_BYTES = 2**63 - 1  # one size (a tensor, a RAM budget) and a graph's total: a signed 64-bit integer
MAX_SECONDS = 1e12  # one node's time, about 31,700 years
MAX_JOULES = 1e18  # one node's energy
# A time or an energy in a graph file or a schedule, one node's or a total: costs come in any unit
# (Checkmate's fcn_8_vgg has a node of 1.62e12), so the only limit is that no sum overflows: a
# schedule's counts fit 64 bits, and any 2^64 of these add up to a finite float.
MAX_QUANTITY = sys.float_info.max / 2**64

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

# A sign is matched so that '-1MB' is refused as negative rather than as unreadable.
_NUMBER = r"([-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?)"
_SIZE_RE = re.compile(rf"^\s*{_NUMBER}\s*([a-zA-Z]*)\s*$")
_TIME_RE = re.compile(rf"^\s*{_NUMBER}\s*([a-zA-Z]*)\s*$")
_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "min": 60.0, "h": 3600.0}


def parse_size(text: str | int | float, *, field: str = "size") -> int:
    """'1.5MB' -> 1500000, '256KiB' -> 262144, 4096 -> 4096. Decimal units are powers of 1000."""
    if isinstance(text, bool) or not isinstance(text, (str, int, float)):
        raise PoetError(f"expected a size such as 1.5MB or 256KiB, got {text!r}", field=field)
    if isinstance(text, int):
        if text <= 0:
            raise PoetError(f"must be a positive size, got {shown(text)}", field=field)
        if text > MAX_BYTES:
            raise PoetError(f"{shown(text)} is too large to be a size (at most 2^63 - 1 bytes)", field=field)
        return text
    if isinstance(text, float):
        value = text
    else:
        match = _SIZE_RE.match(text)
        if not match:
            raise PoetError(f"cannot read {text!r} as a size; write e.g. 1.5MB, 256KiB or 4096B", field=field)
        number, unit = match.groups()
        if unit.lower() not in _SIZE_UNITS:
            raise PoetError(
                f"unknown size unit {unit!r} in {text!r}; use B, KB, KiB, MB, MiB, GB or GiB", field=field
            )
        value = float(number) * _SIZE_UNITS[unit.lower()]
    if math.isnan(value) or value <= 0:
        raise PoetError(f"must be a positive size, got {text!r}", field=field)
    if value > MAX_BYTES:
        raise PoetError(f"{shown(text)} is too large to be a size (at most 2^63 - 1 bytes)", field=field)
    if round(value) < 1:
        raise PoetError(f"{text!r} is less than one byte; sizes are whole bytes", field=field)
    if isinstance(text, str) and not match.group(2):
        # a bare number is too easily meant as KB or MB: ask for the unit rather than guess bytes
        number = text.strip()
        raise PoetError(f"{number!r} has no unit; write {number}B for bytes, or e.g. {number}KiB or {number}MB",
                        field=field)
    return int(round(value))


def parse_runtime(text: str | int | float, plain_runtime_s: float, *, field: str = "runtime") -> float:
    """'1.2x' -> 1.2 * plain training runtime; '2.5s', '300ms' -> seconds (also us, min, h)."""
    if isinstance(text, bool) or not isinstance(text, (str, int, float)):
        raise PoetError(f"expected a runtime such as 1.2x or 2.5s, got {text!r}", field=field)
    if not isinstance(text, str):
        seconds = float(text)
    else:
        match = _TIME_RE.match(text)
        if not match:
            raise PoetError(
                f"cannot read {text!r} as a runtime; write a multiple of plain training such as 1.2x, "
                "or a time such as 2.5s or 300ms",
                field=field,
            )
        number, unit = float(match.group(1)), match.group(2).lower()
        if unit == "x":
            if 0 < number < 1:
                raise PoetError(f"{text!r} is below plain training (1x), which every schedule takes at least: "
                                "each node is computed at least once; give 1x or more", field=field)
            if number > 0 and not plain_runtime_s > 0:
                raise PoetError(f"{text!r} is a multiple of plain training, which takes no time here "
                                "(every node costs 0 s); give a time such as 2.5s", field=field)
            seconds = number * plain_runtime_s
        elif unit in _TIME_UNITS:
            seconds = number * _TIME_UNITS[unit]
        elif unit == "":
            raise PoetError(f"{text!r} has no unit; write 1.2x (times plain training) or 2.5s", field=field)
        else:
            raise PoetError(f"unknown runtime unit {unit!r} in {text!r}; use x, s, ms, us, min or h", field=field)
    if math.isnan(seconds) or seconds <= 0:
        raise PoetError(f"must be positive, got {text!r}", field=field)
    if math.isinf(seconds):
        raise PoetError(f"{text!r} is too large to be a runtime; leave --runtime out for no limit", field=field)
    return seconds


def _scaled(value: float, steps, digits: int) -> str:
    """value in the largest unit of `steps` ((scale, unit), largest first) in which it still shows
    as >= 1 once rounded to `digits` significant figures: 0.99996 s is '1 s', not '1e+03 ms'."""
    for k, (scale, unit) in enumerate(steps):
        text = f"{value / scale:.{digits}g}"
        if abs(float(text)) >= 1 or k == len(steps) - 1:
            return f"{text} {unit}"
    raise AssertionError("unreachable")


def format_bytes(n: float, *, binary: bool = True) -> str:
    """1536000 -> "1.46 MiB" (or "1.54 MB" with binary=False): binary units in everything the tool prints."""
    base, units = (1024.0, ["B", "KiB", "MiB", "GiB", "TiB"]) if binary else (1000.0, ["B", "KB", "MB", "GB", "TB"])
    value = float(n)
    if value == 0 or not math.isfinite(value):
        return f"{value:g} B"
    steps = [(base**k, unit) for k, unit in reversed(list(enumerate(units)))]
    for scale, unit in steps:
        shown = value / scale
        text = f"{shown:.0f}" if unit == "B" else f"{shown:.3g}"
        # the largest unit in which the rounded value is still at least 1 (TB may exceed 1000)
        if abs(float(text)) >= 1 or unit == "B":
            return f"{text} {unit}"
    raise AssertionError("unreachable")


def format_seconds(s: float) -> str:
    """12.3 -> '12.3 s', 0.0004 -> '400 us'; 0.99996 -> '1 s' (never '1e+03 ms')."""
    s = float(s)
    if s == 0 or not math.isfinite(s):
        return f"{s:g} s"
    if abs(s) >= 999.5:
        return f"{s:.0f} s"
    return _scaled(s, [(1.0, "s"), (1e-3, "ms"), (1e-6, "us")], 3)


def format_joules(j: float) -> str:
    """1.2345 -> '1.234 J' (4 significant figures), 0.04 -> '40 mJ', 0 -> '0 J'."""
    j = float(j)
    if j == 0 or not math.isfinite(j):
        return f"{j:g} J"
    if abs(j) >= 9999.5:
        return f"{j:.0f} J"
    return _scaled(j, [(1.0, "J"), (1e-3, "mJ"), (1e-6, "uJ")], 4)
