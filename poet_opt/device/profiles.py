"""Device profiles: YAML files in hardware_profiles/ (or any path a user gives), validated on load.

Every number is SI: bytes, seconds, watts, joules, FLOP/s. Human units are accepted in YAML for
sizes only where the schema says so (e.g. ``ram_bytes: 256KiB``).
"""

from __future__ import annotations

import difflib
import math
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Literal, Optional

import yaml
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator

from poet_opt.errors import PoetError, shown
from poet_opt.files import YAMLLimitError, load_yaml
from poet_opt.units import MAX_BYTES, parse_size

PROFILE_DIR = Path(__file__).resolve().parents[2] / "hardware_profiles"


def _size(value):
    # Raise ValueError (not PoetError) so that pydantic reports the field's own path.
    if isinstance(value, (str, bool)):
        try:
            return parse_size(value, field="size")
        except PoetError as exc:
            raise ValueError(exc.message) from None
    return value


def _number(value):
    # YAML reads `yes`/`true` as a boolean, which pydantic would quietly take as 1; and PyYAML reads
    # exponent floats without a dot or sign (1e5, 1.2e10) as strings. Refuse the first, read the second.
    if isinstance(value, bool):
        raise ValueError(f"expected a number, got {value!r}")
    if isinstance(value, float) and math.isnan(value):  # YAML .nan; pydantic would say "greater than 0"
        raise ValueError("expected a finite number, got .nan")
    if isinstance(value, int) and abs(value) > 1e300:  # pydantic cannot even make it a float
        raise ValueError(f"{shown(value)} is far too large")
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            return value  # pydantic explains: "unable to parse string as a number"
        return int(number) if number.is_integer() and abs(number) < 2**53 else number
    return value


def _within(low: float | None, high: float, unit: str):
    """Sane limits beyond the sign (docs/profiles.md): every cost is a product or quotient of these
    figures and a graph's sizes and times, and must stay finite summed over a whole graph."""
    def check(value):
        if value > high:
            raise ValueError(f"must be at most {high:g} {unit}, got {shown(value)}")
        if low is not None and value < low:
            raise ValueError(f"must be at least {low:g} {unit}, got {shown(value)}")
        return value

    return AfterValidator(check)


def _power_of_two(value: int) -> int:
    if value & (value - 1):
        raise ValueError(f"must be a power of two (1, 2, 4, 8, 16, ...), got {value}")
    return value


Bytes = Annotated[int, BeforeValidator(_size), Field(gt=0), _within(None, MAX_BYTES, "bytes (2^63 - 1)")]
ReserveBytes = Annotated[int, BeforeValidator(_size), Field(ge=0), _within(None, MAX_BYTES, "bytes (2^63 - 1)")]
Count = Annotated[int, BeforeValidator(_number), Field(gt=0), _within(None, MAX_BYTES, "(2^63 - 1)")]
Rate = Annotated[float, BeforeValidator(_number), Field(gt=0, allow_inf_nan=False), _within(1, 1e21, "per second")]
Watts = Annotated[float, BeforeValidator(_number), Field(gt=0, allow_inf_nan=False), _within(None, 1e6, "W")]
JoulesPerFlop = Annotated[float, BeforeValidator(_number), Field(gt=0, allow_inf_nan=False), _within(None, 1.0, "J")]
Latency = Annotated[float, BeforeValidator(_number), Field(ge=0, allow_inf_nan=False), _within(None, 3600.0, "s")]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Compute(_Strict):
    flops_per_second: Rate  # sustained training throughput, not the peak datasheet figure
    active_power_w: Optional[Watts] = None  # board power while computing
    energy_per_flop_j: Optional[JoulesPerFlop] = None
    # the core clock, which turns the emulator's cycle estimate into seconds (microcontrollers)
    clock_hz: Optional[Rate] = None
    # cycles a non-sequential instruction fetch from flash waits, after the part's prefetch buffer
    # or cache: the emulator's cycle estimate adds them to every taken branch
    flash_wait_states: Annotated[int, Field(ge=0, le=64)] = 0

    @model_validator(mode="after")
    def _one_energy_figure(self):
        if self.active_power_w is None and self.energy_per_flop_j is None:
            raise ValueError("give active_power_w or energy_per_flop_j (or both)")
        return self

    @property
    def joules_per_flop(self) -> float:
        if self.energy_per_flop_j is not None:
            return self.energy_per_flop_j
        return self.active_power_w / self.flops_per_second

    @property
    def power_w(self) -> float:
        if self.active_power_w is not None:
            return self.active_power_w
        return self.energy_per_flop_j * self.flops_per_second


class Memory(_Strict):
    ram_bytes: Bytes
    bytes_per_element: Literal[1, 2, 4, 8] = 4
    alignment_bytes: Annotated[Bytes, AfterValidator(_power_of_two)] = 4  # arena offsets are rounded up to it
    # RAM the training step cannot plan with: the call stack (and, on a microcontroller, the
    # firmware's own statics); counted in the device fit of every plan
    stack_reserve_bytes: ReserveBytes = 0


class Transfer(_Strict):
    latency_s: Latency  # fixed cost per transfer (command, seek, block setup)
    bytes_per_second: Rate
    power_w: Watts  # board power while the transfer runs


class Storage(_Strict):
    kind: Literal["sd-card", "spi-flash", "qspi-flash", "internal-flash", "emmc", "nvme", "ssd", "usb"]
    capacity_bytes: Bytes
    erase_block_bytes: Bytes
    endurance_cycles: Count
    write_cache: bool = False
    # the card appends a write that continues the last one within an allocation unit to that unit,
    # without rewriting it (the SD spec's Speed Class model, docs/wear.md); false: each write
    # command may rewrite every unit it touches
    sequential_writes: bool = False
    # None: by kind (SD cards, eMMC, SSDs and USB sticks level wear; raw NOR flash does not)
    wear_levelling: Optional[bool] = None
    read: Transfer
    write: Transfer


class DeviceProfile(_Strict):
    name: str
    description: str
    cpu: str
    compute: Compute
    memory: Memory
    storage: Storage
    source: str = ""  # set by the loader: the file it came from

    def summary_row(self) -> dict:
        return {
            "name": self.name,
            "cpu": self.cpu,
            "ram_bytes": self.memory.ram_bytes,
            "gflops": self.compute.flops_per_second / 1e9,
            "pj_per_flop": self.compute.joules_per_flop * 1e12,
            "storage": self.storage.kind,
            "read_mb_s": self.storage.read.bytes_per_second / 1e6,
            "write_mb_s": self.storage.write.bytes_per_second / 1e6,
        }


def builtin_profile_names() -> list[str]:
    return sorted(p.stem for p in _profile_dir().glob("*.yaml"))


def _profile_dir() -> Path:
    if PROFILE_DIR.is_dir():
        return PROFILE_DIR
    from importlib import resources

    return Path(str(resources.files("poet_opt.hardware_profiles")))


def load_profile(name_or_path: str | Path) -> DeviceProfile:
    """A built-in device name (``rpi4``) or a path to a user's YAML file."""
    text = str(name_or_path)
    path = Path(text)
    looks_like_path = path.suffix in (".yaml", ".yml") or "/" in text or "\\" in text or path.is_file()
    if not looks_like_path:
        names = builtin_profile_names()
        # names are case-insensitive, as model names are: NRF52840 is nrf52840
        by_key = {n.lower(): n for n in names}
        path = _profile_dir() / f"{by_key.get(text.strip().lower(), text)}.yaml"
        if not path.exists():
            close = difflib.get_close_matches(text, names, n=3, cutoff=0.4)
            hint = f"; did you mean {', '.join(close)}?" if close else f"; known devices: {', '.join(names)}"
            raise PoetError(f"unknown device {text!r}{hint} (or give a path to a YAML profile)", field="--device")
    return _load_profile_file(str(path.resolve()))


def _load_profile_file(path: str) -> DeviceProfile:
    try:
        st = Path(path).stat()
        stamp = (st.st_mtime_ns, st.st_size)
    except OSError:
        stamp = None
    # Keyed on the file's modification time and size so that an edited profile is read afresh.
    return _load_profile_cached(path, stamp)


@lru_cache(maxsize=64)
def _load_profile_cached(path: str, stamp) -> DeviceProfile:
    source = path
    try:
        raw = load_yaml(Path(path).read_text())
    except FileNotFoundError:
        raise PoetError("no such profile file", source=source) from None
    except IsADirectoryError:
        raise PoetError("is a directory, not a YAML profile", source=source) from None
    except UnicodeDecodeError:
        raise PoetError("not a text file (a YAML profile is UTF-8 text)", source=source) from None
    except OSError as exc:
        raise PoetError(f"cannot read profile file: {exc.strerror or exc}", source=source) from None
    except YAMLLimitError as exc:  # valid YAML, perhaps, but built to exhaust the reader
        mark = exc.problem_mark
        raise PoetError(f"refused: {exc.problem}", source=source,
                        field=f"line {mark.line + 1}" if mark else "(file)") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise PoetError(f"not valid YAML{where}: {getattr(exc, 'problem', exc)}", source=source) from None
    if raw is None:
        raise PoetError("the file is empty; a profile is a YAML mapping with name:, description:, cpu:, "
                        "compute:, memory: and storage: (docs/profiles.md)", source=source, field="(top level)")
    if not isinstance(raw, dict):
        raise PoetError(f"a profile must be a YAML mapping (name:, compute:, memory:, storage:), "
                        f"got a {type(raw).__name__}", source=source, field="(top level)")
    raw.setdefault("name", Path(path).stem)
    try:
        profile = DeviceProfile.model_validate({**raw, "source": source})
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err["loc"]) or "(top level)"
        message = err["msg"]
        if err["type"] == "missing":
            message = "missing field"
        elif err["type"] == "extra_forbidden":
            message = "unknown field (check the spelling against docs/profiles.md)"
        elif err["type"] == "value_error" and "error" in err.get("ctx", {}):
            message = str(err["ctx"]["error"])  # our own validators' messages, without "Value error, "
        elif "input" in err and not isinstance(err["input"], dict):
            message = f"{message} (got {shown(err['input'])})"
        raise PoetError(message, source=source, field=field) from None
    except PoetError as exc:  # a size string that does not parse
        raise PoetError(exc.message, source=source, field=exc.field) from None
    return profile


def list_profiles() -> list[DeviceProfile]:
    return [load_profile(name) for name in builtin_profile_names()]


