"""Human units at the edges: sizes and runtimes parse strictly (one-line PoetErrors naming the
field), and format back without scientific notation at unit boundaries."""

from __future__ import annotations

import math

import pytest

from poet_opt.errors import PoetError
from poet_opt.units import format_bytes, format_joules, format_seconds, parse_runtime, parse_size


# ---------------------------------------------------------------- parse_size


@pytest.mark.parametrize("text, expected", [
    ("1.5MB", 1_500_000),
    ("256KiB", 262_144),
    ("4096B", 4096),
    ("1e6B", 1_000_000),
    ("1E6B", 1_000_000),
    ("7kb", 7000),
    ("7 kb", 7000),
    ("  1.5 MiB  ", 1_572_864),
    ("2GB", 2_000_000_000),
    ("4GiB", 4 * 1024**3),
    ("1TB", 10**12),
    ("64k", 64_000),
    ("1.B", 1),
    (".5KB", 500),
    ("+3KB", 3000),
    (4096, 4096),
    (1.5e6, 1_500_000),
])
def test_parse_size_reads(text, expected):
    value = parse_size(text)
    assert value == expected
    assert isinstance(value, int)


@pytest.mark.parametrize("text, says", [
    ("", "cannot read"),
    ("   ", "cannot read"),
    ("abc", "cannot read"),
    ("MB", "cannot read"),
    ("1,5MB", "cannot read"),
    ("-1MB", "positive"),
    ("-1", "positive"),
    ("0", "positive"),
    ("0KB", "positive"),
    ("1.5XB", "unknown size unit 'XB'"),
    ("1.5 bits", "unknown size unit"),
    ("nan", "cannot read"),
    ("NaN", "cannot read"),
    ("inf", "cannot read"),
    ("1e400", "too large"),
    ("0.4", "less than one byte"),
    ("4096", "'4096' has no unit; write 4096B for bytes"),
    (" 200 ", "'200' has no unit"),
    (0, "positive"),
    (-5, "positive"),
    (float("nan"), "positive"),
    (float("inf"), "too large"),
    (True, "expected a size"),
    (None, "expected a size"),
])
def test_parse_size_rejects_with_one_line_naming_the_field(text, says):
    with pytest.raises(PoetError) as info:
        parse_size(text, field="--ram")
    line = info.value.one_line()
    assert line.startswith("--ram: ")
    assert says in line
    assert "\n" not in line
    assert info.value.exit_code == 2


def test_parse_size_error_quotes_the_input():
    with pytest.raises(PoetError, match=r"'1\.5XB'"):
        parse_size("1.5XB", field="--ram")


# ---------------------------------------------------------------- parse_runtime


@pytest.mark.parametrize("text, expected", [
    ("1.2x", 12.0),
    ("1.2X", 12.0),
    ("1x", 10.0),
    (" 1.5 x ", 15.0),
    ("2.5s", 2.5),
    ("2.5 s", 2.5),
    ("300ms", 0.3),
    ("250us", 250e-6),
    ("2min", 120.0),
    ("1h", 3600.0),
    (2.5, 2.5),
    (3, 3.0),
])
def test_parse_runtime_reads(text, expected):
    assert parse_runtime(text, 10.0) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("text, says", [
    ("1.2", "no unit"),
    ("12", "no unit"),
    ("-1x", "positive"),
    ("-2.5s", "positive"),
    ("0x", "positive"),
    ("0s", "positive"),
    ("fast", "cannot read"),
    ("", "cannot read"),
    ("x", "cannot read"),
    ("nan", "cannot read"),
    ("inf", "cannot read"),
    ("1e999s", "too large"),
    ("3 days", "unknown runtime unit 'days'"),
    ("2.5sec", "unknown runtime unit"),
    (0, "positive"),
    (-1.0, "positive"),
    (float("nan"), "positive"),
    (float("inf"), "too large"),
    (True, "expected a runtime"),
    (None, "expected a runtime"),
])
def test_parse_runtime_rejects_with_one_line_naming_the_field(text, says):
    with pytest.raises(PoetError) as info:
        parse_runtime(text, 10.0, field="--runtime")
    line = info.value.one_line()
    assert line.startswith("--runtime: ")
    assert says in line
    assert "\n" not in line


def test_parse_runtime_multiple_of_a_plain_runtime_of_zero_is_explained():
    # An imported graph without cost_cpu (or with all zeros) trains "in no time": 1.2x of that is 0.
    with pytest.raises(PoetError, match="takes no time"):
        parse_runtime("1.2x", 0.0, field="--runtime")
    assert parse_runtime("2.5s", 0.0) == 2.5


# ---------------------------------------------------------------- format_*


@pytest.mark.parametrize("n, text", [
    (0, "0 B"),
    (1, "1 B"),
    (999, "999 B"),
    (1000, "1 KB"),
    (8256, "8.26 KB"),
    (1_536_000, "1.54 MB"),
    (1_500_000, "1.5 MB"),
    (999_999, "1 MB"),  # not "1e+03 KB"
    (999_499, "999 KB"),
    (4 * 1024**3, "4.29 GB"),
    (2 * 10**12, "2 TB"),
])
def test_format_bytes_decimal(n, text):
    assert format_bytes(n, binary=False) == text


@pytest.mark.parametrize("n, text", [
    (1023, "1023 B"),
    (1024, "1 KiB"),
    (262_144, "256 KiB"),
    (1_536_000, "1.46 MiB"),
    (4 * 1024**3, "4 GiB"),
    (1024**2 - 1, "1 MiB"),
])
def test_format_bytes_binary(n, text):
    assert format_bytes(n, binary=True) == format_bytes(n) == text  # binary is what the tool prints


@pytest.mark.parametrize("n", [1, 999, 999.6, 1000, 999_999, 10**6 - 500, 123_456_789, 10**15, 5e15])
def test_format_bytes_never_shows_an_exponent_below_the_largest_unit(n):
    for binary, top in ((False, "TB"), (True, "TiB")):
        text = format_bytes(n, binary=binary)
        number, unit = text.split()
        if unit != top:
            assert "e" not in number, text
            assert 1 <= float(number) < (1024 if binary else 1000) or unit == "B"


def test_format_bytes_round_trips_through_parse_size_within_rounding():
    for n in (1, 512, 8256, 262_144, 1_536_000, 4 * 1024**3):
        assert parse_size(format_bytes(n).replace(" ", "")) == pytest.approx(n, rel=5e-3)


@pytest.mark.parametrize("s, text", [
    (0, "0 s"),
    (12.3, "12.3 s"),
    (1, "1 s"),
    (0.99996, "1 s"),  # not "1e+03 ms"
    (0.0134, "13.4 ms"),
    (0.0004, "400 us"),
    (999.4, "999 s"),
    (999.9, "1000 s"),
    (12_345, "12345 s"),
    (math.inf, "inf s"),
])
def test_format_seconds(s, text):
    assert format_seconds(s) == text


@pytest.mark.parametrize("j, text", [
    (0, "0 J"),
    (1.23456, "1.235 J"),
    (0.04, "40 mJ"),
    (0.04006164942411248, "40.06 mJ"),
    (0.9999999, "1 J"),
    (2.5e-6, "2.5 uJ"),
    (12_345.6, "12346 J"),
])
def test_format_joules(j, text):
    assert format_joules(j) == text
