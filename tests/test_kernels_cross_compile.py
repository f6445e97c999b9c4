"""The reference C kernels (poet_opt/firmware/kernels) cross-compile for every Cortex-M the toolchain
knows (M4F, M7F, M0+ and the rest) and reference no library the firmware link lacks; and the
toolchain's errors name what is wrong.

Split from test_kernels.py (the host build against PyTorch): one cross-compilation per CPU takes
most of that module's time, and with ``--dist loadfile`` one long file keeps one worker busy alone.
"""

from __future__ import annotations

import pytest
from elftools.elf.elffile import ELFFile

from poet_opt.errors import PoetError
from poet_opt.firmware import toolchain


# ---- toolchain and cross-compilation ----

def symbols(obj) -> tuple[set[str], set[str]]:
    with open(obj, "rb") as f:
        elf = ELFFile(f)
        assert elf["e_machine"] == "EM_ARM"
        table = elf.get_section_by_name(".symtab")
        names = [(s.name, s["st_shndx"]) for s in table.iter_symbols() if s.name]
    return {n for n, ndx in names if ndx != "SHN_UNDEF"}, {n for n, ndx in names if ndx == "SHN_UNDEF"}


@pytest.mark.parametrize("cpu", sorted(toolchain.CPU_FLAGS))
def test_kernels_cross_compile_without_libraries(tmp_path, cpu):
    """With an FPU, the kernels need nothing at link time: no libm, no libc (no memset/memcpy a
    loop could have become), no double-precision helpers. Without one (M0, M0+, and the M3, M4
    and M7 built soft-float) every float operation is a compiler-rt __aeabi_* call, which zig
    links into any image; nothing else may be missing."""
    defined, undefined = set(), set()
    for obj in toolchain.compile_objects(cpu, tmp_path):
        d, u = symbols(obj)
        defined |= d
        undefined |= u
    missing = undefined - defined
    assert "poet_conv2d_forward" in defined and "poet_adam_step" in defined
    if not toolchain.hard_float(cpu):
        assert all(s.startswith("__aeabi_") for s in missing), sorted(missing)
        assert not [s for s in missing if s.startswith("__aeabi_d")], "double arithmetic crept in"
    else:
        assert not missing, sorted(missing)


def test_toolchain_errors(monkeypatch):
    with pytest.raises(PoetError, match="cortex-m4f"):
        toolchain.cpu_flags("cortex-a53")
    monkeypatch.setattr(toolchain.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(PoetError, match="ziglang"):
        toolchain.zig_cc()
