"""An emulated Cortex-M board that `pip install poet-opt[emulate]` provides: build C firmware for a
device profile's core with zig (the `ziglang` wheel) and run it on unicorn, measuring what the
schedule's cost model predicts (instructions, RAM, storage traffic and wear) without a board.

Why emulate rather than trust the model: the generated training firmware has to fit the part's
RAM with its stack, must respect the semantics of its storage (a NOR flash cannot be rewritten
without an erase; an SD card takes whole 512-byte blocks) and must compute the right numbers.
An emulator that maps memory exactly as the part does, and checks every storage operation as the
device would, catches all three on any machine with Python, with no cross toolchain, no QEMU and
no hardware.

The board is described in targets.py (cores, memory map, ``Target``) and storage_model.py (the
storage device's rules); build.py builds firmware for it. This module runs that firmware.

Measurements: ``RunResult.instructions`` counts executed Thumb instructions with a C block hook
(``board/host_icount.c``, see icount.py) compiled for the host on first use; ``ram_used_bytes`` is
the static data (.data + .bss) plus the deepest stack, found by painting free RAM before the run
and finding the lowest overwritten word after it.

Use::

    from poet_opt.firmware.build import build_firmware
    from poet_opt.firmware.targets import Target, target_from_profile

    target = target_from_profile(load_profile("nrf52840"))     # or Target("cortex-m4f", 256 << 10, ...)
    fw = build_firmware(["train.c", "kernels.c"], target, "build/")
    emu = Emulator(fw)
    emu.storage.load(0, weights_bytes)                          # weights on the SD card / flash
    emu.write_symbol("batch", x)                                # lands when main() starts
    result = emu.run(max_instructions=10**9)
    losses = emu.read_symbol("losses", np.float32)

What it does not model, so a pass here is necessary but not sufficient on the part: timing
(``RunResult.cycles`` is an estimate from a cost per instruction class, cycles.py, not a timed
pipeline); unaligned-access faults on ARMv6-M (unicorn
lets an M0+ do an unaligned word access a real M0+ faults on; C code without casts between
pointer types never does one); CPACR is recorded but unicorn runs FPU instructions even when it
is off; interrupts and peripherals other than the storage controller.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from poet_opt.errors import PoetError
from poet_opt.firmware import icount
from poet_opt.firmware.cycles import cycle_table, taken_branch_cycles
from poet_opt.firmware.build import (
    ElfImage,
    EmulatorError,
    Firmware,
    Symbol,
    build_firmware,
)
from poet_opt.firmware.storage_model import (
    STORAGE_E_IO,
    STORAGE_OK,
    Storage,
    StorageStats,
)
from poet_opt.firmware.targets import (
    FLASH_BASE,
    FLASH_MAP_STEP,
    RAM_BASE,
    RAM_REGION_END,
    SCS_BASE,
    STORAGE_CTRL_BASE,
    TRACE_BASE,
    Target,
)
from poet_opt.signals import signals_held

STACK_PAINT = 0xCDCD_CDCD  # RAM fill before a run; the lowest word that differs is the stack's depth


class EmulatorFault(EmulatorError):
    """The program faulted: an access outside mapped memory, a stack overflow, an undefined
    instruction, a hard fault. ``pc`` is the faulting instruction, ``address`` the data address
    (None when there is none)."""

    def __init__(self, message: str, *, pc: int | None = None, address: int | None = None,
                 kind: str = "fault"):
        self.pc = pc
        self.address = address
        self.kind = kind
        super().__init__(message)


class StackOverflow(EmulatorFault):
    """The stack grew past the start of RAM, or into the static data below it."""


class EmulatorTimeout(EmulatorFault):
    """The program did not finish within the instruction limit or the wall-clock time-out."""


@dataclass(frozen=True)
class RunResult:
    """What one run of the firmware did."""

    exit_code: int  # main's return value (int32)
    instructions: int | None  # executed instructions; None when counting was off
    wall_time_s: float
    ram_bytes: int  # the device's RAM
    static_bytes: int  # .data + .bss
    stack_bytes: int  # deepest stack, from the paint
    storage: StorageStats  # this run's storage traffic, wear and violations
    sections: Mapping[str, int]  # the ELF's allocated sections and their sizes
    cycles: int | None = None  # estimated cycles (cycles.py: per-class costs, taken branches, wait states)

    @property
    def ram_used_bytes(self) -> int:
        return self.static_bytes + self.stack_bytes

    @property
    def instructions_per_second(self) -> float | None:
        if self.instructions is None or self.wall_time_s <= 0:
            return None
        return self.instructions / self.wall_time_s


_EXCP_NAMES = {1: "undefined instruction", 2: "SVC", 3: "prefetch abort", 4: "data abort",
               5: "IRQ", 7: "breakpoint", 16: "semihosting call", 17: "coprocessor (FPU) access "
               "while disabled", 18: "invalid state (ARM-state branch)", 19: "stack limit",
               22: "unaligned access"}
_ARM_VECTOR_NAMES = {2: "NMI", 3: "HardFault", 4: "MemManage", 5: "BusFault", 6: "UsageFault",
                     11: "SVCall", 12: "DebugMonitor", 14: "PendSV", 15: "SysTick"}


class Emulator:
    """Runs a ``Firmware`` on an emulated board: flash, exactly the target's RAM, a storage
    controller, and the target's core.

    The storage (``self.storage``) persists across runs, as a real device's does, and can be
    pre-loaded and read back from the host. Each ``run`` is a power-on reset: RAM is painted,
    the core starts from the vector table, startup.c initialises .data/.bss and calls main().

    ``count_instructions``: count executed instructions (a C block hook; 5-15% of the speed).
    ``watch_stack``: also read the stack pointer at every function entry (no measurable cost on
    top of counting), which stops the run as soon as a call finds the stack inside the static
    data, a collision that no memory fault reveals (the stack is still in RAM), and measures
    frames that paint cannot see. Both off: unicorn's full speed, paint-only stack measurement,
    no instruction count.
    """

    def __init__(self, firmware: Firmware, *, storage: Storage | None = None,
                 count_instructions: bool = True, watch_stack: bool = True):
        from unicorn import arm_const

        self.firmware = firmware
        self.target = firmware.target
        self.core = self.target.core_spec
        self._uc_model = getattr(arm_const, self.core.uc_model, None)
        if self._uc_model is None:
            raise PoetError(f"this unicorn has no {self.core.uc_model} CPU model for "
                            f"{self.core.description}; upgrade unicorn", field="--device")
        self.image = ElfImage.load(Path(firmware.elf_path))
        self.storage = storage if storage is not None else Storage(self.target)
        self.count_instructions = count_instructions or watch_stack
        self.watch_stack = watch_stack
        self.ram_bytes = int(self.target.ram_bytes)
        if self.image.estack != RAM_BASE + self.ram_bytes:
            raise EmulatorError(f"{firmware.elf_path} was linked for {self.image.estack - RAM_BASE} "
                                f"bytes of RAM, the target has {self.ram_bytes}")

        image_end = max(addr + len(data) for addr, data in self.image.loads)
        if image_end > RAM_BASE:
            raise EmulatorError(f"{firmware.elf_path} loads data outside flash (at 0x{image_end:x})")
        if self.target.flash_bytes:
            self.flash_bytes = int(self.target.flash_bytes)
        else:
            self.flash_bytes = max(FLASH_MAP_STEP, -(-image_end // FLASH_MAP_STEP) * FLASH_MAP_STEP)
        if image_end > self.flash_bytes:
            raise EmulatorError(f"the image ({image_end} bytes) exceeds the {self.flash_bytes}-byte flash")
        self.flash = np.full(self.flash_bytes, 0xFF, dtype=np.uint8)  # erased flash
        for addr, data in self.image.loads:
            self.flash[addr - FLASH_BASE:addr - FLASH_BASE + len(data)] = np.frombuffer(data, np.uint8)
        self.ram = np.zeros(self.ram_bytes, dtype=np.uint8)
        self._pending: list[tuple[int, bytes]] = []  # host writes to RAM symbols, applied at main
        self._uc = None
        self._fault: EmulatorFault | None = None
        self._stop_reason: tuple | None = None
        self._reach: list[tuple[int, Any]] = []  # on_reach's, installed again at every power-on
        self._power_on()

    # -- host access to symbols ---------------------------------------------------------------

    def symbol(self, name: str) -> Symbol:
        try:
            return self.image.symbols[name]
        except KeyError:
            raise KeyError(f"{self.firmware.elf_path.name} has no symbol {name!r} (unused globals "
                           f"are removed by --gc-sections; reference it, or mark it "
                           f"__attribute__((used)))") from None

    def memory_at(self, addr: int, nbytes: int, *, flash: bool = True) -> tuple[np.ndarray, int] | None:
        """The host array that holds the ``nbytes`` at ``addr``, RAM or (with ``flash``) flash, and
        where in it they start; None when they are not all in one of the two."""
        if RAM_BASE <= addr and addr + nbytes <= RAM_BASE + self.ram_bytes:
            return self.ram, addr - RAM_BASE
        if flash and FLASH_BASE <= addr and addr + nbytes <= FLASH_BASE + self.flash_bytes:
            return self.flash, addr - FLASH_BASE
        return None

    def _region(self, sym: Symbol, offset: int, nbytes: int) -> tuple[np.ndarray, int]:
        if offset < 0 or (sym.size and offset + nbytes > sym.size):
            raise ValueError(f"{sym.name} is {sym.size} bytes; cannot access {nbytes} bytes at "
                             f"offset {offset}")
        found = self.memory_at(sym.address + offset, nbytes)
        if found is None:
            raise ValueError(f"{sym.name} (0x{sym.address + offset:08x}) is neither in RAM nor in flash")
        return found

    def read_symbol(self, name: str, dtype: Any = np.uint8, *, count: int | None = None,
                    offset: int = 0) -> np.ndarray:
        """A copy of the symbol's bytes (all of it, or ``count`` items of ``dtype`` from byte
        ``offset``) as it stands now: after a run, what the program left there; writes still
        pending for the next run included."""
        sym = self.symbol(name)
        dt = np.dtype(dtype)
        nbytes = (sym.size - offset) if count is None else count * dt.itemsize
        nbytes -= nbytes % dt.itemsize
        mem, start = self._region(sym, offset, nbytes)
        out = mem[start:start + nbytes].copy()
        if mem is self.ram:
            lo = sym.address + offset
            for addr, data in self._pending:
                a, b = max(addr, lo), min(addr + len(data), lo + nbytes)
                if a < b:
                    out[a - lo:b - lo] = np.frombuffer(data[a - addr:b - addr], np.uint8)
        return out.view(dt)

    def write_symbol(self, name: str, data: Any, *, offset: int = 0) -> None:
        """Set the symbol's bytes (``data``: bytes or an array, written in its native layout).

        Flash symbols (const data) are patched into the image now. RAM symbols are written when
        the next run enters main(), after startup.c has initialised .data and zeroed .bss, which
        would otherwise overwrite them."""
        sym = self.symbol(name)
        if isinstance(data, (bytes, bytearray, memoryview)):
            raw = bytes(data)
        elif isinstance(data, (np.ndarray, np.generic)):
            raw = np.ascontiguousarray(data).tobytes()
        else:
            # A list would become float64 or int64 silently; the C type is the caller's to say.
            raise TypeError(f"write_symbol({name!r}): pass bytes or a numpy array/scalar of the "
                            f"symbol's C type, not {type(data).__name__}")
        mem, start = self._region(sym, offset, len(raw))
        if mem is self.flash:
            self.flash[start:start + len(raw)] = np.frombuffer(raw, np.uint8)
        else:
            self._pending.append((sym.address + offset, raw))

    # -- machine --------------------------------------------------------------------------------

    def _power_on(self) -> None:
        from unicorn import (UC_ARCH_ARM, UC_HOOK_INTR, UC_HOOK_MEM_INVALID, UC_MODE_MCLASS, UC_MODE_THUMB,
                             UC_PROT_ALL, UC_PROT_EXEC, UC_PROT_READ, Uc)

        uc = Uc(UC_ARCH_ARM, UC_MODE_THUMB | UC_MODE_MCLASS)
        uc.ctl_set_cpu_model(self._uc_model)
        # Both memories are host numpy arrays mapped by pointer: the host reads symbols, paints
        # and measures the stack without copies. Flash is not writable by the program (a store
        # to it faults, as on a part whose flash is programmed through its controller).
        uc.mem_map_ptr(FLASH_BASE, self.flash_bytes, UC_PROT_READ | UC_PROT_EXEC, self.flash.ctypes.data)
        uc.mem_map_ptr(RAM_BASE, self.ram_bytes, UC_PROT_ALL, self.ram.ctypes.data)
        self.ram.view(np.uint32)[:] = STACK_PAINT
        self._controller = _StorageController(self)
        uc.mmio_map(STORAGE_CTRL_BASE, 0x1000, self._controller.read, None, self._controller.write, None)
        # the profiled step's marks: the cycle estimate is read here, once per schedule step
        uc.mmio_map(TRACE_BASE, 0x1000, self._trace_read, None, self._trace_write, None)
        self.marks: list[tuple[int, int]] = []  # (the word written, estimated cycles then)
        self._scs = {0xD88: 0}  # CPACR: the FPU is off at reset
        uc.mmio_map(SCS_BASE, 0x1000, self._scs_read, None, self._scs_write, None)
        uc.hook_add(UC_HOOK_INTR, self._on_interrupt)
        uc.hook_add(UC_HOOK_MEM_INVALID, self._on_invalid_memory)
        self._uc = uc
        for address, callback in self._reach:
            self._hook_reach(address, callback)
        self._icount = None
        if self.count_instructions:
            self._install_counter(uc)

    def on_reach(self, address: int, callback) -> None:
        """Call ``callback()`` each time the core is about to execute ``address`` (a function's entry),
        in every run: the host's turn mid-run, to fill RAM the program reads next (``memory_at``) as a
        peripheral's DMA would, without stopping the run or building the image again."""
        self._reach.append((address, callback))
        self._hook_reach(address, callback)

    def _hook_reach(self, address: int, callback) -> None:
        from unicorn import UC_HOOK_CODE

        self._uc.hook_add(UC_HOOK_CODE, lambda uc, at, size, data: callback(), begin=address, end=address)

    def _install_counter(self, uc) -> None:
        self._icount = icount.install(
            uc, self.flash, FLASH_BASE, sp_limit=self.image.static_end if self.watch_stack else None,
            function_entries=[f.address for f in self.image.functions],
            costs=cycle_table(self.target.core).vector(),
            taken_cost=taken_branch_cycles(self.target.core, self.target.flash_wait_states))

    def _pc(self, uc) -> int:
        from unicorn.arm_const import UC_ARM_REG_PC

        return int(uc.reg_read(UC_ARM_REG_PC))

    def where(self, pc: int | None) -> str:
        if pc is None:
            return "pc unknown"
        name = self.image.where(pc)
        return f"pc 0x{pc:08x}" + (f" ({name})" if name else "")

    def describe_address(self, addr: int) -> str:
        ram_end = RAM_BASE + self.ram_bytes
        ram = f"RAM is 0x{RAM_BASE:08x}-0x{ram_end - 1:08x}, {_kib(self.ram_bytes)}"
        if ram_end <= addr < RAM_REGION_END:
            return f"past the end of RAM ({ram})"
        if self.flash_bytes <= addr < RAM_BASE:
            if addr >= RAM_BASE - 0x10000:
                return f"just below the start of RAM ({ram})"
            return f"past the end of flash (flash is 0x00000000-0x{self.flash_bytes - 1:08x})"
        if FLASH_BASE <= addr < self.flash_bytes:
            return f"in flash, which the program cannot write (0x00000000-0x{self.flash_bytes - 1:08x})"
        if RAM_BASE <= addr < ram_end:
            return f"in RAM ({ram})"
        return "unmapped: the emulated board has no memory or peripheral there"

    def _on_invalid_memory(self, uc, access, address, size, value, user_data) -> bool:
        from unicorn import (UC_MEM_FETCH_PROT, UC_MEM_FETCH_UNMAPPED, UC_MEM_READ_PROT, UC_MEM_READ_UNMAPPED,
                             UC_MEM_WRITE_PROT, UC_MEM_WRITE_UNMAPPED)
        from unicorn.arm_const import UC_ARM_REG_SP

        pc = self._pc(uc)
        sp = int(uc.reg_read(UC_ARM_REG_SP))
        what = {UC_MEM_READ_UNMAPPED: "read from", UC_MEM_READ_PROT: "read from",
                UC_MEM_WRITE_UNMAPPED: "write to", UC_MEM_WRITE_PROT: "write to",
                UC_MEM_FETCH_UNMAPPED: "instruction fetch from",
                UC_MEM_FETCH_PROT: "instruction fetch from"}.get(access, "access to")
        where = self.describe_address(address)
        if (RAM_BASE - 0x10000 <= address < RAM_BASE) and sp < RAM_BASE + 0x400:
            fault = StackOverflow(
                f"stack overflow: {size}-byte {what} 0x{address:08x} at {self.where(pc)}, sp "
                f"0x{sp:08x}: the stack grew past the start of RAM ({_kib(self.ram_bytes)}, of which "
                f"{self.firmware.static_bytes} bytes static data)", pc=pc, address=address,
                kind="stack overflow")
        elif access in (UC_MEM_FETCH_UNMAPPED, UC_MEM_FETCH_PROT):
            fault = EmulatorFault(f"bus fault: {what} 0x{address:08x} ({where}); a jump "
                                  f"through a bad pointer or a corrupted return address",
                                  pc=address, address=address, kind="bus fault")
        else:
            fault = EmulatorFault(f"bus fault: {size}-byte {what} 0x{address:08x} ({where}) "
                                  f"at {self.where(pc)}", pc=pc, address=address, kind="bus fault")
        if self._fault is None:
            self._fault = fault
        return False

    def _on_interrupt(self, uc, intno, user_data) -> None:
        from unicorn import UcError
        from unicorn.arm_const import UC_ARM_REG_R0, UC_ARM_REG_R1

        pc = self._pc(uc)
        r0 = int(uc.reg_read(UC_ARM_REG_R0))
        if intno == 7:  # EXCP_BKPT
            imm = int(self.flash[pc]) if FLASH_BASE <= pc < self.flash_bytes else None
            if imm == 0:
                self._stop_reason = ("exit", r0 - (1 << 32) if r0 & 0x8000_0000 else r0, pc)
                uc.emu_stop()
                return
            if imm == 1:
                frame = int(uc.reg_read(UC_ARM_REG_R1))
                vec = _ARM_VECTOR_NAMES.get(r0 & 0x1FF, f"exception {r0 & 0x1FF}")
                try:
                    stacked_pc = int.from_bytes(uc.mem_read(frame + 24, 4), "little")
                except UcError:
                    stacked_pc = None
                fault = EmulatorFault(f"{vec}: the core took a fault; the faulting "
                                      f"instruction is at {self.where(stacked_pc)}",
                                      pc=stacked_pc, kind=vec)
            else:
                fault = EmulatorFault(f"breakpoint bkpt #{imm} at {self.where(pc)} (the board "
                                      f"uses bkpt #0 for exit and #1 for faults)", pc=pc,
                                      kind="breakpoint")
        else:
            name = _EXCP_NAMES.get(intno, f"exception {intno}")
            fault = EmulatorFault(f"{name} at {self.where(pc)}", pc=pc, kind=name)
        self._stop_with(uc, fault)

    def _stop_with(self, uc, fault: EmulatorFault) -> None:
        """Record a fault found in a callback and stop the core. Not raised there: an exception
        cannot cross unicorn's C frames (the binding would print it for a read callback and
        return garbage to the program); run() raises it once emu_start returns. The first fault
        wins, as later ones are its consequences."""
        if self._fault is None:
            self._fault = fault
        uc.emu_stop()

    def _near(self, uc) -> str:
        """Where an MMIO access came from. unicorn updates the pc register only at the start of
        a basic block for MMIO callbacks, so name the block's pc and the link register (in a
        driver function, where it was called from)."""
        from unicorn.arm_const import UC_ARM_REG_LR

        lr = int(uc.reg_read(UC_ARM_REG_LR)) & ~1
        return f"in the basic block at {self.where(self._pc(uc))} (lr: {self.where(lr)})"

    def _trace_write(self, uc, offset, size, value, user_data) -> None:
        if offset != 0 or size != 4:
            self._bad_trace(uc, offset, "write")
            return
        # the block hook has already added the whole current block: the few instructions after
        # the store in it land on the mark before; a mark costs one Python call, not per instruction
        cycles = int(self._icount[0].cycles) if self._icount is not None else 0
        self.marks.append((int(value) & 0xFFFF_FFFF, cycles))

    def _trace_read(self, uc, offset, size, user_data) -> int:
        self._bad_trace(uc, offset, "read")
        return 0

    def _bad_trace(self, uc, offset: int, what: str) -> None:
        self._stop_with(uc, EmulatorFault(
            f"{what} of 0x{TRACE_BASE + offset:08x} {self._near(uc)}: the trace register takes 32-bit writes "
            f"at 0x{TRACE_BASE:08x} only", pc=self._pc(uc), address=TRACE_BASE + offset, kind="bus fault"))

    def _scs_read(self, uc, offset, size, user_data) -> int:
        if offset == 0xD00:
            return self.core.cpuid
        if offset == 0xD88:
            return self._scs[0xD88]
        self._unmodelled(uc, SCS_BASE + offset, "read")
        return 0

    def _scs_write(self, uc, offset, size, value, user_data) -> None:
        if offset == 0xD88:
            self._scs[0xD88] = value & 0x00F0_0000 if self.core.hard_float else 0
            return
        self._unmodelled(uc, SCS_BASE + offset, "write")

    def _unmodelled(self, uc, addr: int, what: str) -> None:
        self._stop_with(uc, EmulatorFault(
            f"{what} of system register 0x{addr:08x} {self._near(uc)}: the emulated board models "
            f"CPUID and CPACR only", pc=self._pc(uc), address=addr, kind="unmodelled register"))

    # -- run ------------------------------------------------------------------------------------

    def run(self, *, max_instructions: int | None = None, timeout_s: float | None = None) -> RunResult:
        """Power on, run to the `bkpt #0` after main() returns, and measure.

        ``max_instructions`` stops a runaway program (checked once per basic block, so it may
        overshoot by one block); ``timeout_s`` bounds the wall-clock time. Either raises
        ``EmulatorTimeout``. A fault raises ``EmulatorFault`` (``StackOverflow`` for the stack).
        """
        from unicorn import UC_QUERY_TIMEOUT, UcError
        from unicorn.arm_const import UC_ARM_REG_SP, UC_ARM_REG_XPSR

        if self._ran:
            self._power_on()
        self._ran = True
        uc = self._uc
        before = self.storage.stats()
        self._fault = None
        self._stop_reason = None
        sp0, reset = (int(x) for x in self.flash[0:8].view(np.uint32))
        uc.reg_write(UC_ARM_REG_SP, sp0)
        count = 0
        if self._icount is not None:
            self._icount[0].limit = int(max_instructions or 0)
        elif max_instructions:
            count = int(max_instructions)  # unicorn's own per-instruction counter: slower
        deadline = None if timeout_s is None else time.perf_counter() + timeout_s

        def emu(begin: int, until: int) -> None:
            timeout_us = 0
            if deadline is not None:
                timeout_us = max(1, int((deadline - time.perf_counter()) * 1e6))
            try:
                _emu_interruptibly(uc, begin | 1, until, timeout_us, count)
            except UcError as exc:
                if self._fault is not None:
                    raise self._fault from None
                pc = self._pc(uc)
                text = str(exc)
                if "INSN_INVALID" in text or "Invalid instruction" in text:
                    if not (int(uc.reg_read(UC_ARM_REG_XPSR)) >> 24) & 1:
                        # EPSR.T clear: a BX/BLX/POP to an address without bit 0 set, which
                        # Cortex-M (Thumb only) answers with an INVSTATE UsageFault.
                        raise EmulatorFault(f"invalid state: branch to 0x{pc:08x} with bit 0 clear "
                                            f"(an ARM-state address; Cortex-M executes Thumb only)"
                                            f"{' in ' + self.image.where(pc) if self.image.where(pc) else ''}",
                                            pc=pc, kind="invalid state") from None
                    raise EmulatorFault(f"undefined instruction at {self.where(pc)}", pc=pc,
                                        kind="undefined instruction") from None
                raise EmulatorFault(f"emulation stopped at {self.where(pc)}: {text}", pc=pc) from None
            if self._fault is not None:  # raised from an MMIO callback or a bkpt #1
                raise self._fault
            if deadline is not None and uc.query(UC_QUERY_TIMEOUT):
                pc = self._pc(uc)
                raise EmulatorTimeout(f"the program did not finish within {timeout_s:g} s "
                                      f"(stopped at {self.where(pc)})", pc=pc, kind="timeout")

        start = time.perf_counter()
        # Phase 1: reset handler up to main(), so that host writes land after startup.c's
        # .data copy and .bss clear. `until` costs nothing per instruction.
        emu(reset, self.image.main)
        if self._stop_reason is None and self._pc(uc) == self.image.main:
            for addr, data in self._pending:
                self.ram[addr - RAM_BASE:addr - RAM_BASE + len(data)] = np.frombuffer(data, np.uint8)
            self._pending.clear()
            emu(self.image.main, 0xFFFF_FFFF)
        wall = time.perf_counter() - start

        instructions = cycles = None
        if self._icount is not None:
            state = self._icount[0]
            instructions = int(state.instructions) if self.count_instructions else None
            cycles = int(state.cycles) if self.count_instructions else None
            if state.sp_fault:
                self._raise_stack_into_statics(int(state.min_sp), int(state.sp_fault_pc))
        if self._stop_reason is None:
            pc = self._pc(uc)
            limit_hit = (self._icount is not None and self._icount[0].limit_hit) or (
                count and self._icount is None)
            if limit_hit and max_instructions:
                raise EmulatorTimeout(f"the program did not finish within {max_instructions:,} "
                                      f"instructions (stopped at {self.where(pc)})", pc=pc, kind="timeout")
            raise EmulatorError(f"emulation stopped at {self.where(pc)} before the program finished")
        _, exit_code, _ = self._stop_reason

        stack = self._stack_depth()
        return RunResult(exit_code=exit_code, instructions=instructions, wall_time_s=wall,
                         ram_bytes=self.ram_bytes, static_bytes=self.firmware.static_bytes,
                         stack_bytes=stack, storage=self.storage.stats().since(before),
                         sections=dict(self.firmware.sections), cycles=cycles)

    _ran = False

    def close(self) -> None:
        """Release unicorn now, while the RAM and flash arrays it maps and the counter's state are
        still alive: left to interpreter shutdown (after a Ctrl-C, say), the order of teardown is
        arbitrary and uc_close may touch freed memory."""
        import gc

        uc, self._uc = self._uc, None
        if uc is not None:
            try:
                uc.emu_stop()
            except Exception:  # not running: nothing to stop
                pass
            del uc
            with signals_held():  # a Ctrl-C during the collection would land in a finalizer, and be lost
                gc.collect()
        self._icount = None

    def _raise_stack_into_statics(self, sp: int, pc: int) -> None:
        static_end = self.image.static_end
        raise StackOverflow(
            f"stack overflow: the stack pointer reached 0x{sp:08x}, {static_end - sp} bytes into "
            f"the static data (.data/.bss end at 0x{static_end:08x}), at {self.where(pc)}; "
            f"{_kib(self.ram_bytes)} of RAM leaves {self.image.estack - static_end} bytes for the "
            f"stack", pc=pc, address=sp, kind="stack overflow")

    def _stack_depth(self) -> int:
        """Bytes of stack used at the deepest point: from the top of RAM down to the lowest
        painted word (between the static data and the top) that the run overwrote, or to the
        lowest stack pointer seen at a function entry (``watch_stack``) if that is lower. Paint
        alone misses stack reserved but never written (a local array left partly unused); the
        stack pointer at entries alone misses the frames of leaf functions."""
        lo = (self.image.static_end - RAM_BASE + 3) // 4
        words = self.ram.view(np.uint32)[lo:]
        changed = np.flatnonzero(words != STACK_PAINT)
        if changed.size == 0:
            return 0
        deepest = lo + int(changed[0])
        if self.watch_stack and self._icount is not None:
            # a frame reserved below the deepest written word still counts (sp at a call)
            deepest = min(deepest, (int(self._icount[0].min_sp) - RAM_BASE) // 4)
        if deepest <= lo and words.size:
            addr = RAM_BASE + 4 * lo
            raise StackOverflow(f"stack overflow: the stack (or a write past the last static "
                                f"array) reached the end of the static data at 0x{addr:08x}, "
                                f"using all {self.image.estack - addr} bytes that "
                                f"{_kib(self.ram_bytes)} of RAM leaves for it, and may have "
                                f"overwritten .bss", address=addr, kind="stack overflow")
        return self.image.estack - (RAM_BASE + 4 * deepest)


class _StorageController:
    """The emulated storage controller's registers (see board/poet_storage_emu.c)."""

    OP, OFFSET, ADDR, LEN, BLOCK, GO, STATUS = 0x00, 0x04, 0x08, 0x0C, 0x10, 0x14, 0x18
    OP_READ, OP_WRITE, OP_ERASE = 1, 2, 3

    def __init__(self, emu: Emulator):
        self.emu = emu
        self.regs = {self.OP: 0, self.OFFSET: 0, self.ADDR: 0, self.LEN: 0, self.BLOCK: 0,
                     self.STATUS: 0}

    def read(self, uc, offset, size, user_data) -> int:
        if offset in self.regs and size == 4:
            return self.regs[offset] & 0xFFFF_FFFF
        self._bad(uc, offset, "read")
        return 0

    def write(self, uc, offset, size, value, user_data) -> None:
        if size != 4 or offset not in self.regs and offset != self.GO:
            self._bad(uc, offset, "write")
        elif offset == self.GO:
            self.regs[self.STATUS] = self._go(uc) & 0xFFFF_FFFF
        elif offset != self.STATUS:
            self.regs[offset] = value & 0xFFFF_FFFF

    def _bad(self, uc, offset: int, what: str) -> None:
        self.emu._stop_with(uc, EmulatorFault(
            f"{what} of storage controller register 0x{STORAGE_CTRL_BASE + offset:08x} "
            f"{self.emu._near(uc)}: not a 32-bit access to a register the controller has",
            pc=self.emu._pc(uc), address=STORAGE_CTRL_BASE + offset, kind="bus fault"))

    def _memory(self, uc, addr: int, length: int, writable: bool) -> np.ndarray | None:
        """The RAM (or, for a source, flash) the DMA touches; a range outside them is a firmware
        bug the real controller would bus-fault on (None, with the fault recorded)."""
        emu = self.emu
        found = emu.memory_at(addr, length, flash=not writable)
        if found is not None:
            mem, start = found
            return mem[start:start + length]
        emu._stop_with(uc, EmulatorFault(
            f"storage DMA {'into' if writable else 'from'} 0x{addr:08x}..0x{addr + length:08x} "
            f"({emu.describe_address(addr + length - 1 if length else addr)}) {emu._near(uc)}",
            pc=emu._pc(uc), address=addr, kind="bus fault"))
        return None

    def _go(self, uc) -> int:
        from unicorn.arm_const import UC_ARM_REG_LR

        storage = self.emu.storage
        op, offset, addr, length = (self.regs[k] for k in (self.OP, self.OFFSET, self.ADDR, self.LEN))
        pc = (self.emu._pc(uc), int(uc.reg_read(UC_ARM_REG_LR)) & ~1)  # see Emulator._near
        if op in (self.OP_READ, self.OP_WRITE):
            if length == 0:
                return STORAGE_OK
            # a storage read is DMA into RAM; a write takes its data from RAM or flash
            memory = self._memory(uc, addr, length, writable=op == self.OP_READ)
            if memory is None:
                return STORAGE_E_IO
            if op == self.OP_WRITE:
                return storage.device_write(offset, memory.copy(), pc)
            status, data = storage.device_read(offset, length, pc)
            if status == STORAGE_OK:
                memory[:] = data
            return status
        if op == self.OP_ERASE:
            return storage.device_erase(self.regs[self.BLOCK], pc)
        return storage.violation("op", offset, length, f"unknown storage controller operation {op}",
                                 pc, STORAGE_E_IO)


def _emu_interruptibly(uc, begin: int, until: int, timeout_us: int, count: int) -> None:
    """uc.emu_start on a worker thread: unicorn's loop runs in C (the binding releases the GIL), so
    a Ctrl-C in the main thread would otherwise wait for the whole run. On KeyboardInterrupt the
    emulation is stopped (emu_stop is safe from another thread) and the interrupt goes on."""
    import threading

    failure: list[BaseException] = []

    def run() -> None:
        try:
            uc.emu_start(begin, until, timeout=timeout_us, count=count)
        except BaseException as exc:  # handed to the caller's thread
            failure.append(exc)

    worker = threading.Thread(target=run, name="poet-emulator", daemon=True)
    worker.start()
    try:
        while worker.is_alive():
            worker.join(0.05)
    except KeyboardInterrupt:
        uc.emu_stop()
        worker.join()
        raise
    if failure:
        raise failure[0]


def _kib(n: int) -> str:
    return f"{n // 1024} KiB" if n % 1024 == 0 else f"{n} bytes"


def emulate(sources: Sequence[str | Path], target: Target, out_dir: str | Path, *,
            max_instructions: int | None = None, timeout_s: float | None = None,
            **build_kwargs) -> RunResult:
    """Build ``sources`` for ``target`` and run them once: the one-call form for a quick check."""
    fw = build_firmware(sources, target, out_dir, **build_kwargs)
    return Emulator(fw).run(max_instructions=max_instructions, timeout_s=timeout_s)
