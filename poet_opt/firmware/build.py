"""Firmware for the emulated board: C sources cross-compiled with zig cc (toolchain.py) for the
target's core, with the board's start-up code and storage port, linked to its memory map; and
what the emulator reads back from the ELF (loadable bytes, section sizes, symbols)."""

from __future__ import annotations

import bisect
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from poet_opt.firmware.c_text import constant, identifier
from poet_opt.firmware.targets import (
    DEFAULT_FLASH_LINK_BYTES,
    FLASH_BASE,
    RAM_BASE,
    Target,
)
from poet_opt.firmware.toolchain import WARNING_FLAGS, cpu_flags, run_zig, zig_cc

BOARD_DIR = Path(__file__).resolve().parent / "board"


class EmulatorError(Exception):
    """The firmware could not be built or did not run to completion."""


class FirmwareBuildError(EmulatorError):
    """zig cc failed; ``log`` holds the command and the compiler's full output."""

    def __init__(self, message: str, log: str = ""):
        self.log = log
        super().__init__(message if not log else f"{message}\n{log}")


def run_zig_build(commands: Sequence[Sequence[str]], what: str, timeout_s: float) -> None:
    """Run zig commands side by side (``toolchain.run_zig``); the first failure raises
    FirmwareBuildError, headed by the linker script's ``poet:`` message when there is one."""
    failure = run_zig(commands, timeout_s=timeout_s)
    if failure is None:
        return
    shown = "$ " + " ".join(failure.command)
    if failure.timed_out:
        raise FirmwareBuildError(f"{what}: zig cc did not finish within {timeout_s:.0f} s", shown)
    # Our linker-script ASSERTs say exactly what does not fit; lead with them.
    m = re.search(r"poet: [^\n\"]+", failure.output)
    headline = f"{what}: {m.group(0)}" if m else f"{what} failed"
    raise FirmwareBuildError(headline, shown + "\n" + failure.output)


def _define_flags(defines: Mapping[str, Any]) -> list[str]:
    return [f"-D{identifier(key)}" if value is None else f"-D{identifier(key)}={constant(value)}"
            for key, value in defines.items()]


# the section of the arena the generated library with the default prefix declares (library.py)
ARENA_SECTIONS = (".poet_arena",)


def render_linker_script(target: Target, *, min_stack_bytes: int = 1024,
                         arena_sections: Sequence[str] = ARENA_SECTIONS, heading: str = "") -> str:
    """board/link.ld.in with this target's flash and RAM sizes and the arenas' sections (one per
    library prefix linked in) filled in, after ``heading`` (a whole C comment, or nothing)."""
    text = (BOARD_DIR / "link.ld.in").read_text()
    values = {"FLASH_BYTES": target.flash_bytes or DEFAULT_FLASH_LINK_BYTES,
              "RAM_BYTES": target.ram_bytes, "MIN_STACK_BYTES": int(min_stack_bytes)}
    for key, value in values.items():
        text = text.replace(f"@{key}@", f"0x{int(value):X}")
    kept = [f"        KEEP(*({'.' + identifier(name.lstrip('.'))}))" for name in arena_sections]
    text = heading + text.replace("@ARENA_SECTIONS@", "\n".join(kept))
    leftover = re.search(r"@[A-Z_]+@", text)
    if leftover:  # pragma: no cover - template and code changed apart
        raise EmulatorError(f"link.ld.in has an unfilled field {leftover.group(0)}")
    return text


@dataclass(frozen=True)
class Firmware:
    """A linked image for a target."""

    elf_path: Path
    target: Target
    sections: Mapping[str, int]  # allocated section -> size in bytes
    flash_image_bytes: int  # code + read-only data + .data load image
    static_bytes: int  # RAM taken by .data + .bss (with alignment)

    @classmethod
    def from_elf(cls, elf_path: str | Path, target: Target) -> Firmware:
        """Describe an ELF linked with board/link.ld.in (by ``build_firmware`` or otherwise)."""
        info = ElfImage.load(Path(elf_path))
        return cls(Path(elf_path), target, dict(info.sections), info.flash_end - FLASH_BASE,
                   info.static_end - RAM_BASE)


def common_cflags(target: Target, *, opt: str = "-O2", std: str = "c99") -> list[str]:
    """Flags every translation unit of the firmware is compiled with: the core's -target/-mcpu and
    the bare-metal code generation flags of ``toolchain.cpu_flags``, exactly as the C kernels get
    them, without warnings (``build_firmware`` adds them); no debug information; the board's
    headers and the storage geometry poet_storage.h requires."""
    return [*cpu_flags(target.core, opt=opt, std=std, warnings=()), "-g0", f"-I{BOARD_DIR}",
            *_define_flags(target.storage_defines())]


def build_firmware(sources: Sequence[str | Path], target: Target, out_dir: str | Path, *,
                   name: str = "firmware", include_dirs: Iterable[str | Path] = (),
                   defines: Mapping[str, Any] | None = None, cflags: Sequence[str] = (),
                   warnings: Sequence[str] = WARNING_FLAGS, opt: str = "-O2", std: str = "c99",
                   min_stack_bytes: int = 1024, timeout_s: float = 300.0,
                   arena_sections: Sequence[str] = ARENA_SECTIONS, linker_heading: str = "") -> Firmware:
    """Cross-compile ``sources`` with the board's start-up code and storage port, link with the
    target's memory map, and return the ``Firmware`` (``out_dir/name.elf``; zig's linker writes
    no map file, ``Firmware.sections`` and the ELF's symbols say where everything went).

    The board's own sources build with -Wall -Wextra -Werror -pedantic; ``warnings`` sets the
    user sources' warning flags (the same by default). compiler_rt is linked explicitly
    (``--rtlib=compiler-rt``): with ``-nostdlib`` zig would otherwise leave __aeabi_* helpers,
    soft-float routines and memcpy/memset undefined. The link fails with a ``poet:`` message when
    static data plus ``min_stack_bytes`` exceeds RAM, or the image exceeds ``target.flash_bytes``.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sources = [Path(s) for s in sources]
    for s in sources:
        if not s.is_file():
            raise FirmwareBuildError(f"firmware source {s} does not exist")
    compile_ = [*zig_cc(), *common_cflags(target, opt=opt, std=std)]
    user_flags = [*(f"-I{d}" for d in include_dirs), *_define_flags(defines or {}), *cflags]

    link_ld = out / f"{name}.ld"
    link_ld.write_text(render_linker_script(target, min_stack_bytes=min_stack_bytes, arena_sections=arena_sections,
                                            heading=linker_heading))

    # Board objects: strict warnings regardless of what the user's sources get.
    board = {src: out / f"{name}.board.{Path(src).stem}.o" for src in ("startup.c", "poet_storage_emu.c")}
    run_zig_build([[*compile_, *WARNING_FLAGS, "-c", str(BOARD_DIR / src), "-o", str(obj)]
                   for src, obj in board.items()], "compiling the board support", timeout_s)

    elf = out / f"{name}.elf"
    run_zig_build([[*compile_, *warnings, *user_flags, *map(str, sources), *map(str, board.values()),
                    "-nostdlib", "--rtlib=compiler-rt", "-Wl,--entry=Reset_Handler", "-T", str(link_ld),
                    "-o", str(elf)]], f"building {name}", timeout_s)
    return Firmware.from_elf(elf, target)


# --------------------------------------------------------------------------------------------
# ELF
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Symbol:
    name: str
    address: int
    size: int
    kind: str  # "object" or "func"


class ElfImage:
    """What the emulator needs from the ELF: loadable bytes, section sizes, symbols."""

    def __init__(self, path: Path):
        from elftools.elf.elffile import ELFFile

        self.path = path
        with open(path, "rb") as fh:
            elf = ELFFile(fh)
            if elf["e_machine"] != "EM_ARM" or elf.elfclass != 32:
                raise EmulatorError(f"{path} is not a 32-bit Arm ELF")
            self.entry = elf["e_entry"]
            # Load by physical (load) address: .data's initial values go to flash, where
            # startup.c copies them from, exactly as a flash programmer writes the image.
            self.loads = [(seg["p_paddr"], seg.data()) for seg in elf.iter_segments()
                          if seg["p_type"] == "PT_LOAD" and seg["p_filesz"] > 0]
            self.sections = {}
            for sec in elf.iter_sections():
                if sec["sh_flags"] & 0x2 and sec["sh_size"]:  # SHF_ALLOC
                    self.sections[sec.name] = int(sec["sh_size"])
            symtab = elf.get_section_by_name(".symtab")
            if symtab is None:
                raise EmulatorError(f"{path} has no symbol table (was it stripped?)")
            self.symbols: dict[str, Symbol] = {}
            funcs = []
            for sym in symtab.iter_symbols():
                kind = sym["st_info"]["type"]
                if not sym.name:
                    continue
                if kind == "STT_FUNC":
                    s = Symbol(sym.name, int(sym["st_value"]) & ~1, int(sym["st_size"]), "func")
                    funcs.append(s)
                elif kind in ("STT_OBJECT", "STT_NOTYPE"):
                    s = Symbol(sym.name, int(sym["st_value"]), int(sym["st_size"]), "object")
                else:
                    continue
                # Prefer global definitions over local aliases of the same name.
                if sym.name not in self.symbols or sym["st_info"]["bind"] == "STB_GLOBAL":
                    self.symbols[sym.name] = s
        self._funcs = sorted(funcs, key=lambda s: s.address)
        self.functions: tuple[Symbol, ...] = tuple(self._funcs)
        self._func_addrs = [s.address for s in self._funcs]
        need = ("_estack", "_poet_static_end", "_poet_flash_end", "main", "Reset_Handler")
        missing = [n for n in need if n not in self.symbols]
        if missing:
            raise EmulatorError(f"{path} was not linked with board/link.ld.in and startup.c "
                                f"(missing {', '.join(missing)})")
        self.static_end = self.symbols["_poet_static_end"].address
        self.flash_end = self.symbols["_poet_flash_end"].address
        self.estack = self.symbols["_estack"].address
        self.main = self.symbols["main"].address

    _cache: ClassVar[dict[tuple[str, float, int], ElfImage]] = {}

    @classmethod
    def load(cls, path: Path) -> ElfImage:
        st = path.stat()
        key = (str(path.resolve()), st.st_mtime, st.st_size)
        if key not in cls._cache:
            cls._cache[key] = cls(path)
        return cls._cache[key]

    def where(self, pc: int) -> str:
        """'name+0xoff' for a code address, or '' when no function contains it."""
        i = bisect.bisect_right(self._func_addrs, pc & ~1) - 1
        if i >= 0:
            f = self._funcs[i]
            if pc - f.address < max(f.size, 1) or (f.size == 0 and pc - f.address < 64):
                return f"{f.name}+0x{pc - f.address:x}"
        return ""
