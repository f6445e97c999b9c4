"""Device profiles: the built-in YAML files load, carry their sources, agree with POET's published
constants, are physically plausible; malformed profiles fail as one-line PoetErrors naming the file
and the field."""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

import pytest
import yaml

from poet_opt.errors import PoetError
from poet_opt.device.profiles import PROFILE_DIR, DeviceProfile, builtin_profile_names, list_profiles, load_profile

REQUIRED = {"mkr1000", "nrf52840", "stm32f746", "rpi4", "rpi4-nocache", "rpi3", "jetson-tx2", "jetson-nano"}
MICROCONTROLLERS = {"mkr1000": 32 * 1024, "nrf52840": 256 * 1024, "stm32f746": 320 * 1024}
LINUX_BOARDS = {"rpi4", "rpi4-nocache", "rpi3", "jetson-tx2", "jetson-nano"}
NAMES = builtin_profile_names()

KiB, MiB = 1024, 1024 * 1024


def _transfer_s(transfer, nbytes: float) -> float:
    return transfer.latency_s + nbytes / transfer.bytes_per_second


def _page_in_j(p: DeviceProfile, nbytes: float) -> float:
    return _transfer_s(p.storage.read, nbytes) * p.storage.read.power_w


def _page_out_j(p: DeviceProfile, nbytes: float) -> float:
    return _transfer_s(p.storage.write, nbytes) * p.storage.write.power_w


def _typical_activation_bytes(p: DeviceProfile) -> int:
    """An activation that a training schedule on this device would page: an eighth of RAM, at most 1 MiB."""
    return min(p.memory.ram_bytes // 8, MiB)


# --------------------------------------------------------------------------------------------
# The built-in set


def test_required_profiles_are_built_in():
    assert REQUIRED <= set(NAMES), f"missing: {sorted(REQUIRED - set(NAMES))}"


def test_list_profiles_matches_builtin_names():
    profiles = list_profiles()
    assert [p.name for p in profiles] == NAMES
    assert all(isinstance(p, DeviceProfile) for p in profiles)


@pytest.mark.parametrize("name", NAMES)
def test_builtin_profile_loads_by_name_and_by_path(name):
    by_name = load_profile(name)
    by_path = load_profile(PROFILE_DIR / f"{name}.yaml")
    assert by_name == by_path
    assert Path(by_name.source).name == f"{name}.yaml"
    row = by_name.summary_row()
    assert row["name"] == name and row["gflops"] > 0 and row["pj_per_flop"] > 0


@pytest.mark.parametrize("name", NAMES)
def test_name_field_equals_file_stem(name):
    raw = yaml.safe_load((PROFILE_DIR / f"{name}.yaml").read_text())
    assert raw.get("name") == name, "write name: explicitly, equal to the file name without .yaml"
    assert load_profile(name).name == name


_VALUE_LINE = re.compile(r"^\s*([A-Za-z_]+):\s*([^#\s][^#]*?)\s*(#.*)?$")


@pytest.mark.parametrize("name", NAMES)
def test_every_number_says_where_it_comes_from(name):
    lines = (PROFILE_DIR / f"{name}.yaml").read_text().splitlines()
    assert lines and lines[0].startswith("#"), "start with a header comment: the board and the sources"
    for lineno, line in enumerate(lines, 1):
        m = _VALUE_LINE.match(line)
        if not m or m.group(1) in ("name", "description", "cpu"):
            continue
        assert m.group(3) and len(m.group(3).strip("# ")) >= 8, (
            f"{name}.yaml line {lineno}: {m.group(1)} has no source comment: {line.strip()!r}")


# --------------------------------------------------------------------------------------------
# Plausibility


@pytest.mark.parametrize("name", NAMES)
def test_compute_figures_are_plausible(name):
    c = load_profile(name).compute
    assert 1e4 <= c.flops_per_second <= 1e14, "FLOP/s: from a soft-float MCU to an edge GPU"
    assert 1e-3 <= c.power_w <= 100, "watts"
    assert 1e-13 <= c.joules_per_flop <= 1e-5, "J/FLOP"
    assert math.isclose(c.joules_per_flop * c.flops_per_second, c.power_w, rel_tol=1e-9)


@pytest.mark.parametrize("name", NAMES)
def test_storage_figures_are_plausible(name):
    p = load_profile(name)
    s = p.storage
    for t in (s.read, s.write):
        assert 1e3 <= t.bytes_per_second <= 1e10
        assert 0 <= t.latency_s <= 0.1
        assert 1e-3 <= t.power_w <= 20
        assert 1e-11 <= t.power_w / t.bytes_per_second <= 1e-5, "J per byte moved"
    assert s.read.bytes_per_second >= s.write.bytes_per_second, "flash reads faster than it writes"
    assert s.read.latency_s <= s.write.latency_s
    assert s.erase_block_bytes <= s.capacity_bytes
    assert s.capacity_bytes >= p.memory.ram_bytes, "secondary storage is the bigger memory"
    assert s.endurance_cycles >= 100


@pytest.mark.parametrize("name", NAMES)
def test_recomputing_a_conv_costs_more_than_paging_it_but_a_relu_is_cheaper_to_recompute(name):
    """POET's premise: page the outputs of expensive operators, rematerialise the cheap ones. For a
    typical activation, recomputing a 3x3 convolution over 64 input channels (2*9*64 FLOP per output
    element) must cost more energy than reading it back, and even than writing and reading it; an
    elementwise ReLU (1 FLOP per element) must be cheaper to recompute than that round trip."""
    p = load_profile(name)
    nbytes = _typical_activation_bytes(p)
    elements = nbytes / p.memory.bytes_per_element
    conv_j = elements * 2 * 9 * 64 * p.compute.joules_per_flop
    relu_j = elements * 1 * p.compute.joules_per_flop
    page_in_j = _page_in_j(p, nbytes)
    round_trip_j = page_in_j + _page_out_j(p, nbytes)
    assert page_in_j < conv_j
    assert round_trip_j < conv_j
    assert relu_j < round_trip_j
    # ...and neither side is absurdly dominant: a conv recompute is not a million page-ins.
    assert conv_j / page_in_j < 1e5


@pytest.mark.parametrize("name, ram", sorted(MICROCONTROLLERS.items()))
def test_microcontrollers_have_tens_to_hundreds_of_kb_of_ram(name, ram):
    p = load_profile(name)
    assert 16 * KiB <= p.memory.ram_bytes <= 1 * MiB
    assert p.memory.ram_bytes == ram
    assert p.memory.alignment_bytes == 4
    assert "Cortex-M" in p.cpu


@pytest.mark.parametrize("name", sorted(LINUX_BOARDS))
def test_application_processors_have_gigabytes_and_vector_alignment(name):
    p = load_profile(name)
    assert p.memory.ram_bytes >= 512 * MiB
    assert p.memory.alignment_bytes == 16
    assert "Cortex-A" in p.cpu


def test_all_builtins_train_in_fp32():
    assert {p.memory.bytes_per_element for p in list_profiles()} == {4}


def test_rpi4_nocache_pages_out_slower_than_rpi4():
    cached, uncached = load_profile("rpi4"), load_profile("rpi4-nocache")
    assert cached.storage.write_cache and not uncached.storage.write_cache
    w, wn = cached.storage.write, uncached.storage.write
    assert wn.bytes_per_second < w.bytes_per_second or wn.latency_s > w.latency_s
    assert wn.bytes_per_second <= w.bytes_per_second and wn.latency_s >= w.latency_s
    for nbytes in (4 * KiB, MiB, 64 * MiB):
        assert _transfer_s(wn, nbytes) > _transfer_s(w, nbytes)
        assert _page_out_j(uncached, nbytes) > _page_out_j(cached, nbytes)
    # Same board otherwise.
    assert uncached.compute == cached.compute
    assert uncached.memory == cached.memory
    assert uncached.storage.read == cached.storage.read


def test_boards_order_sensibly():
    pi3, pi4 = load_profile("rpi3"), load_profile("rpi4")
    assert pi3.compute.flops_per_second < pi4.compute.flops_per_second
    assert pi3.storage.read.bytes_per_second < pi4.storage.read.bytes_per_second
    nano, tx2 = load_profile("jetson-nano"), load_profile("jetson-tx2")
    assert nano.compute.flops_per_second < tx2.compute.flops_per_second
    assert nano.memory.ram_bytes < tx2.memory.ram_bytes
    mcu_peak = max(load_profile(n).compute.flops_per_second for n in MICROCONTROLLERS)
    assert mcu_peak < min(load_profile(n).compute.flops_per_second for n in LINUX_BOARDS)


# --------------------------------------------------------------------------------------------
# Agreement with POET's published constants (github.com/ShishirPatil/poet, poet/chipsets.py)

_BENCH_FLOP = 16283 * 100 * 1000
POET = {
    "mkr1000": dict(
        flops=2000 / 0.012, flop_per_joule=2000 / (0.012 * 0.020 * 3.3),
        pagein_latency=0.109e-3, pagein_throughput=4616.51e3,
        pageout_latency=0.113e-3, pageout_throughput=4440e3, memory_power=0.100 * 3.3),
    "nrf52840": dict(
        flops=_BENCH_FLOP / 255.6237, flop_per_joule=_BENCH_FLOP / (255.6237 * 0.003328 * 3.3),
        pagein_latency=0.109e-3, pagein_throughput=4616.51e3,
        pageout_latency=0.113e-3, pageout_throughput=4440e3, memory_power=0.100 * 3.3),
    "rpi4": dict(
        flops=_BENCH_FLOP / 13.53, flop_per_joule=_BENCH_FLOP / (13.53 * 0.6 * 5),
        pagein_latency=0.00509561e-3, pagein_throughput=45.5e6,
        pageout_latency=0.0185314e-3, pageout_throughput=24.5e6, memory_power=0.030 * 5),
    "rpi4-nocache": dict(
        flops=_BENCH_FLOP / 13.53, flop_per_joule=_BENCH_FLOP / (13.53 * 0.6 * 5),
        pagein_latency=0.00509561e-3, pagein_throughput=45.5e6,
        pageout_latency=4.23532e-3, pageout_throughput=17.1e6, memory_power=0.030 * 5),
    "jetson-tx2": dict(
        pagein_latency=0.00054, pagein_throughput=108.5e6,
        pageout_latency=0.002396, pageout_throughput=94.37e6, memory_power=0.309),
}


@pytest.mark.parametrize("name", sorted(POET))
def test_profile_reproduces_poets_constants(name):
    poet, p = POET[name], load_profile(name)
    close = lambda a, b: math.isclose(a, b, rel_tol=1e-6)  # noqa: E731
    if "flops" in poet:
        assert close(p.compute.flops_per_second, poet["flops"])
        # POET's FLOPS_PER_WATT is FLOP per joule: the energy per FLOP must be its inverse.
        assert close(p.compute.joules_per_flop, 1 / poet["flop_per_joule"])
    s = p.storage
    assert close(s.read.latency_s, poet["pagein_latency"])
    assert close(s.read.bytes_per_second, poet["pagein_throughput"])
    assert close(s.write.latency_s, poet["pageout_latency"])
    assert close(s.write.bytes_per_second, poet["pageout_throughput"])
    assert close(s.read.power_w, poet["memory_power"]) and close(s.write.power_w, poet["memory_power"])


def test_jetson_tx2_compute_power_is_poets_one_core_figure():
    assert math.isclose(load_profile("jetson-tx2").compute.power_w, (995 - 229) * 1e-3, rel_tol=1e-9)


# --------------------------------------------------------------------------------------------
# User profiles and malformed files


def _builtin_raw(name: str = "rpi4") -> dict:
    return yaml.safe_load((PROFILE_DIR / f"{name}.yaml").read_text())


def _write(tmp_path: Path, raw, filename: str = "board.yaml") -> Path:
    path = tmp_path / filename
    path.write_text(raw if isinstance(raw, str) else yaml.safe_dump(raw, sort_keys=False))
    return path


def _error(path_or_name) -> PoetError:
    with pytest.raises(PoetError) as info:
        load_profile(path_or_name)
    err = info.value
    line = err.one_line()
    assert "\n" not in line
    assert str(err) == line
    return err


def test_users_own_yaml_path_loads(tmp_path):
    raw = _builtin_raw("nrf52840")
    raw["name"] = "my-board"
    raw["memory"]["ram_bytes"] = "192KiB"
    path = _write(tmp_path, raw, "my-board.yaml")
    for arg in (path, str(path)):
        p = load_profile(arg)
        assert p.name == "my-board"
        assert p.memory.ram_bytes == 192 * 1024
        assert p.source == str(path.resolve())


def test_user_profile_name_defaults_to_file_stem(tmp_path):
    raw = _builtin_raw()
    del raw["name"]
    assert load_profile(_write(tmp_path, raw, "pi-in-the-lab.yaml")).name == "pi-in-the-lab"


def test_energy_per_flop_alone_is_enough(tmp_path):
    raw = _builtin_raw()
    del raw["compute"]["active_power_w"]
    raw["compute"]["energy_per_flop_j"] = 2e-8
    raw["compute"]["flops_per_second"] = "1e8"  # PyYAML reads 1e8 as a string; it still counts
    p = load_profile(_write(tmp_path, raw))
    assert p.compute.joules_per_flop == 2e-8
    assert math.isclose(p.compute.power_w, 2.0)


def test_size_strings_and_units(tmp_path):
    raw = _builtin_raw()
    raw["memory"]["ram_bytes"] = "1.5MB"
    raw["storage"]["capacity_bytes"] = "64GB"
    raw["storage"]["erase_block_bytes"] = 4096
    p = load_profile(_write(tmp_path, raw))
    assert (p.memory.ram_bytes, p.storage.capacity_bytes, p.storage.erase_block_bytes) == (1_500_000, 64 * 10**9, 4096)


def test_edited_profile_is_read_again(tmp_path):
    raw = _builtin_raw()
    path = _write(tmp_path, raw)
    assert load_profile(path).compute.active_power_w == 3.0
    raw["compute"]["active_power_w"] = 4.25
    _write(tmp_path, raw)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert load_profile(path).compute.active_power_w == 4.25


def test_a_directory_named_like_a_device_does_not_shadow_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "rpi4").mkdir()
    assert load_profile("rpi4").name == "rpi4"


def _mutated(tmp_path, mutate) -> tuple[Path, PoetError]:
    raw = _builtin_raw()
    mutate(raw)
    path = _write(tmp_path, raw)
    return path, _error(path)


def _assert_names(err: PoetError, path: Path, field: str, *words: str):
    line = err.one_line()
    assert str(path.resolve()) in line, line
    assert err.field == field, line
    assert field in line
    for word in words:
        assert word in line, line


def test_missing_field_is_named(tmp_path):
    path, err = _mutated(tmp_path, lambda raw: raw["storage"].pop("read"))
    _assert_names(err, path, "storage.read", "missing field")


def test_missing_section_is_named(tmp_path):
    path, err = _mutated(tmp_path, lambda raw: raw.pop("compute"))
    _assert_names(err, path, "compute", "missing field")


def test_negative_value_is_named(tmp_path):
    path, err = _mutated(tmp_path, lambda raw: raw["compute"].update(flops_per_second=-1))
    _assert_names(err, path, "compute.flops_per_second", "greater than 0", "-1")


def test_negative_latency_is_named(tmp_path):
    path, err = _mutated(tmp_path, lambda raw: raw["storage"]["write"].update(latency_s=-0.001))
    _assert_names(err, path, "storage.write.latency_s", "greater than or equal to 0")


def test_non_numeric_value_is_named(tmp_path):
    path, err = _mutated(tmp_path, lambda raw: raw["compute"].update(flops_per_second="fast"))
    _assert_names(err, path, "compute.flops_per_second", "'fast'", "number")


def test_boolean_is_not_a_number(tmp_path):
    path, err = _mutated(tmp_path, lambda raw: raw["storage"]["read"].update(bytes_per_second=True))
    _assert_names(err, path, "storage.read.bytes_per_second", "expected a number")


def test_unreadable_size_is_named_by_its_field(tmp_path):
    path, err = _mutated(tmp_path, lambda raw: raw["memory"].update(ram_bytes="lots"))
    _assert_names(err, path, "memory.ram_bytes", "'lots'")


def test_unknown_field_is_named(tmp_path):
    path, err = _mutated(tmp_path, lambda raw: raw["compute"].update(flops_per_sec=1e9))
    _assert_names(err, path, "compute.flops_per_sec", "unknown field")


def test_unknown_top_level_field_is_named(tmp_path):
    path, err = _mutated(tmp_path, lambda raw: raw.update(colour="green"))
    _assert_names(err, path, "colour", "unknown field")


def test_unknown_storage_kind_is_named(tmp_path):
    path, err = _mutated(tmp_path, lambda raw: raw["storage"].update(kind="floppy"))
    _assert_names(err, path, "storage.kind", "'floppy'", "sd-card")


def test_no_energy_figure_is_named(tmp_path):
    path, err = _mutated(tmp_path, lambda raw: raw["compute"].pop("active_power_w"))
    _assert_names(err, path, "compute", "active_power_w", "energy_per_flop_j")


def test_invalid_yaml_names_the_file(tmp_path):
    path = _write(tmp_path, "name: board\ncompute: {flops_per_second: [1, 2\n")
    err = _error(path)
    line = err.one_line()
    assert str(path.resolve()) in line and "not valid YAML" in line and "line" in line


@pytest.mark.parametrize("text", ["- compute\n- memory\n", "just a string\n", "", "42\n"])
def test_non_mapping_file_names_the_file(tmp_path, text):
    path = _write(tmp_path, text)
    line = _error(path).one_line()
    assert str(path.resolve()) in line and "mapping" in line


def test_missing_file_names_the_file(tmp_path):
    path = tmp_path / "nowhere.yaml"
    line = _error(path).one_line()
    assert str(path.resolve()) in line and "no such profile file" in line


def test_directory_is_not_a_profile(tmp_path):
    line = _error(str(tmp_path) + "/").one_line()
    assert "directory" in line


def test_unknown_device_suggests_close_names():
    err = _error("rpi5")
    line = err.one_line()
    assert "rpi5" in line and "rpi4" in line and "did you mean" in line
    assert err.field == "--device"
    assert "jetson-nano" in _error("jetson-nan").one_line()


def test_unknown_device_without_close_match_lists_devices():
    line = _error("quantum-toaster").one_line()
    for name in ("mkr1000", "rpi4", "jetson-tx2"):
        assert name in line
