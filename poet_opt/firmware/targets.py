"""What the emulated board is: its Cortex-M core, its memory map and its storage device, from a
device profile or given as plain values.

Memory map (that of nRF52840, STM32F7 and SAMD21 parts):

====================  ==============================================================
0x00000000            flash: vector table, code, read-only data, .data load image.
                      Mapped read/execute only, sized to the linked image rounded up
                      to a 1 MiB step (``FLASH_MAP_STEP``), or to ``Target.flash_bytes``
                      when the profile gives the part's flash size. Reads past it fault.
0x20000000            RAM: exactly ``Target.ram_bytes``. .data and .bss at the bottom,
                      the stack from the top down. Nothing else is mapped up to
                      0x3FFFFFFF, so an access past the end of RAM faults, and so does a
                      stack that grows below 0x20000000.
0x40000000            storage controller registers (``STORAGE_CTRL_BASE``, one 4 KiB page).
                      The storage itself is behind the controller, not memory-mapped,
                      as an SPI/QSPI flash or an SD card is.
0x40001000            trace register (``TRACE_BASE``): a word written there is recorded
                      with the cycle estimate of that moment (firmware/profile.py marks
                      the steps of a profiled training step with it). Emulator only.
0xE000E000            System Control Space: CPUID and CPACR only (the start-up code
                      enables the FPU there); any other SCS register faults.
====================  ==============================================================
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from poet_opt.errors import PoetError
from poet_opt.firmware import toolchain

FLASH_BASE = 0x0000_0000
RAM_BASE = 0x2000_0000
RAM_REGION_END = 0x4000_0000  # the SRAM region of the Armv7-M/Armv6-M memory map
STORAGE_CTRL_BASE = 0x4000_0000  # keep in step with POET_EMU_STORAGE_BASE in poet_storage_emu.c
TRACE_BASE = 0x4000_1000  # the one word poet_mark() writes (writer.py, marks=True)
SCS_BASE = 0xE000_E000
FLASH_MAP_STEP = 1 << 20
# Flash the linker may use when the profile gives no flash size: the whole code region below RAM.
DEFAULT_FLASH_LINK_BYTES = RAM_BASE - FLASH_BASE
MAX_STORAGE_ADDRESSABLE = 1 << 32  # poet_storage.h offsets are uint32_t
BLOCK_DEVICE_BLOCK_BYTES = 512

FLASH_KINDS = ("spi-flash", "qspi-flash", "internal-flash")
BLOCK_KINDS = ("sd-card", "emmc")


# --------------------------------------------------------------------------------------------
# Cores
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CoreSpec:
    """Which unicorn CPU model runs one core and what it reports; how to compile for it is
    ``toolchain.CPU_FLAGS[name]``, the table the C kernels are compiled with too."""

    name: str  # a toolchain.CPU_FLAGS key
    uc_model: str  # name of the UC_CPU_ARM_* constant
    cpuid: int  # what the SCB CPUID register reads (Arm TRM values)
    description: str

    @property
    def hard_float(self) -> bool:
        return toolchain.hard_float(self.name)


CORES: dict[str, CoreSpec] = {
    c.name: c for c in (
        # unicorn has no M0+ model; the M0 runs the same ARMv6-M instruction set.
        CoreSpec("cortex-m0plus", "UC_CPU_ARM_CORTEX_M0", 0x410CC601, "Arm Cortex-M0+ (ARMv6-M, no FPU, soft-float)"),
        CoreSpec("cortex-m0", "UC_CPU_ARM_CORTEX_M0", 0x410CC200, "Arm Cortex-M0 (ARMv6-M, no FPU, soft-float)"),
        CoreSpec("cortex-m3", "UC_CPU_ARM_CORTEX_M3", 0x412FC231, "Arm Cortex-M3 (ARMv7-M, no FPU, soft-float)"),
        CoreSpec("cortex-m4", "UC_CPU_ARM_CORTEX_M4", 0x410FC241, "Arm Cortex-M4 without FPU (soft-float)"),
        CoreSpec("cortex-m4f", "UC_CPU_ARM_CORTEX_M4", 0x410FC241, "Arm Cortex-M4F (FPv4-SP, hard-float)"),
        CoreSpec("cortex-m7", "UC_CPU_ARM_CORTEX_M7", 0x411FC270, "Arm Cortex-M7 without FPU (soft-float)"),
        CoreSpec("cortex-m7f", "UC_CPU_ARM_CORTEX_M7", 0x411FC270,
                 "Arm Cortex-M7 with single-precision FPv5 (hard-float)"),
        CoreSpec("cortex-m7fd", "UC_CPU_ARM_CORTEX_M7", 0x411FC270,
                 "Arm Cortex-M7 with double-precision FPv5 (hard-float)"),
    )
}


def core_for_cpu(cpu: str) -> str:
    """The ``CORES`` key for a profile's free-text ``cpu:`` field (or a core key itself).

    "Arm Cortex-M4F @ 64 MHz" -> cortex-m4f; "Arm Cortex-M7 ... single-precision FPU" -> cortex-m7f
    ("double-precision" -> cortex-m7fd, "no FPU" -> cortex-m7; an M7 that says nothing about its FPU
    is taken as single-precision, the common STM32F7 configuration); "Cortex-M0+" -> cortex-m0plus;
    an M4 is hard-float when it is called M4F or its text mentions an FPU that it does not deny.
    Anything else raises PoetError naming the cores the emulator has.
    """
    text = " ".join(str(cpu).lower().replace("_", "-").split())
    if text in CORES:
        return text
    m = re.search(r"cortex[- ]?m(\d+)(\+|plus|f)?", text)
    no_fpu = re.search(r"no (hardware )?fpu|without (an? )?fpu|soft-?float", text) is not None
    fpu = ("fpu" in text or "floating" in text) and not no_fpu
    core = None
    if m:
        number, suffix = m.group(1), m.group(2) or ""
        if number == "0":
            core = "cortex-m0plus" if suffix in ("+", "plus") else "cortex-m0"
        elif number == "3":
            core = "cortex-m3"
        elif number == "4":
            core = "cortex-m4f" if (suffix == "f" or fpu) else "cortex-m4"
        elif number == "7":
            core = "cortex-m7" if no_fpu else ("cortex-m7fd" if "double" in text else "cortex-m7f")
    if core is None:
        raise PoetError(f"the emulator has no model of the CPU {str(cpu)!r}; it emulates Arm "
                        f"Cortex-M0/M0+, M3, M4(F) and M7(F) cores (cpu: in the device profile)",
                        field="--device")
    return core


# --------------------------------------------------------------------------------------------
# Target
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """What the emulated board is: plain values, so that callers need not import the profile
    module. ``core`` is a ``CORES`` key or a profile's ``cpu:`` text (normalised on creation)."""

    core: str
    ram_bytes: int
    storage_kind: str = "spi-flash"
    storage_capacity_bytes: int = 16 << 20
    erase_block_bytes: int = 4096
    flash_bytes: int | None = None  # None: as much as the image needs (mapped in 1 MiB steps)
    name: str = ""
    flash_wait_states: int = 0  # cycles a non-sequential instruction fetch waits (cycles.py)
    # a block device that appends a write continuing the previous one in an allocation unit
    # (storage_model.py counts its wear so; the profile's storage.sequential_writes)
    sequential_writes: bool = False

    def __post_init__(self):
        object.__setattr__(self, "core", core_for_cpu(self.core))
        where = f"device {self.name!r}: " if self.name else ""
        ram = int(self.ram_bytes)
        if ram <= 0 or ram % 4096 or ram > RAM_REGION_END - RAM_BASE:
            # unicorn maps whole 4 KiB pages; a RAM size that is not a multiple could not fault
            # exactly at its end.
            raise PoetError(f"{where}RAM of {ram} bytes: the emulator needs a positive multiple of "
                            f"4 KiB up to 512 MiB", field="--device")
        if self.storage_kind not in FLASH_KINDS + BLOCK_KINDS:
            raise PoetError(f"{where}storage kind {self.storage_kind!r} has no emulated model; the "
                            f"emulator models {', '.join(FLASH_KINDS + BLOCK_KINDS)}", field="--device")
        if self.erase_block_bytes <= 0 or self.storage_capacity_bytes < self.erase_block_bytes:
            raise PoetError(f"{where}storage of {self.storage_capacity_bytes} bytes with erase blocks of "
                            f"{self.erase_block_bytes} bytes is not a device", field="--device")
        if self.storage_kind in BLOCK_KINDS and (self.erase_block_bytes % BLOCK_DEVICE_BLOCK_BYTES
                                                 or self.storage_capacity_bytes % BLOCK_DEVICE_BLOCK_BYTES):
            raise PoetError(f"{where}{self.storage_kind}: capacity and allocation unit must be whole "
                            f"512-byte blocks", field="--device")
        if self.flash_bytes is not None and (self.flash_bytes <= 0 or self.flash_bytes % 4096
                                             or self.flash_bytes > DEFAULT_FLASH_LINK_BYTES):
            raise PoetError(f"{where}flash of {self.flash_bytes} bytes: the emulator needs a positive "
                            f"multiple of 4 KiB below 512 MiB", field="--device")

    @property
    def core_spec(self) -> CoreSpec:
        return CORES[self.core]

    @property
    def is_flash(self) -> bool:
        return self.storage_kind in FLASH_KINDS

    @property
    def write_block_bytes(self) -> int:
        """Smallest write unit: 1 byte on NOR flash, a 512-byte block on SD/eMMC."""
        return 1 if self.is_flash else BLOCK_DEVICE_BLOCK_BYTES

    @property
    def erased_byte(self) -> int:
        # NOR flash erases to ones; SD/eMMC erase commands leave zeros on most cards (the card's
        # DATA_STAT_AFTER_ERASE bit says which).
        return 0xFF if self.is_flash else 0x00

    @property
    def addressable_bytes(self) -> int:
        """Storage reachable through poet_storage.h's uint32_t offsets."""
        return min(int(self.storage_capacity_bytes), MAX_STORAGE_ADDRESSABLE)

    def storage_defines(self) -> dict[str, str]:
        """The -D values poet_storage.h requires, from this target's storage geometry."""
        return {
            "POET_STORAGE_CAPACITY_BYTES": f"{self.addressable_bytes}ULL",
            "POET_STORAGE_ERASE_BLOCK_BYTES": f"{int(self.erase_block_bytes)}u",
            "POET_STORAGE_WRITE_BLOCK_BYTES": f"{self.write_block_bytes}u",
            "POET_STORAGE_ERASE_REQUIRED": "1" if self.is_flash else "0",
            "POET_STORAGE_ERASED_BYTE": f"0x{self.erased_byte:02X}u",
        }


def target_from_profile(profile: Any, *, flash_bytes: int | None = None) -> Target:
    """A ``Target`` from a device profile object (``.cpu``, ``.memory.ram_bytes``,
    ``.storage.kind``, ``.storage.capacity_bytes``, ``.storage.erase_block_bytes``, ``.name``).
    Duck-typed so that it works wherever the profile class lives."""
    storage = profile.storage
    return Target(core=profile.cpu, ram_bytes=int(profile.memory.ram_bytes),
                  storage_kind=str(storage.kind), storage_capacity_bytes=int(storage.capacity_bytes),
                  erase_block_bytes=int(storage.erase_block_bytes), flash_bytes=flash_bytes,
                  name=str(getattr(profile, "name", "") or ""),
                  flash_wait_states=int(getattr(getattr(profile, "compute", None), "flash_wait_states", 0) or 0),
                  # behind a write cache the emulated card still sees each command as the port issues it
                  sequential_writes=bool(getattr(storage, "sequential_writes", False))
                  and str(storage.kind) in BLOCK_KINDS)
