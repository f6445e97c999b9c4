"""Library prefixes (issue 29, item 1): each generated library exports only names with its prefix,
so two models link into one image and train side by side; `emulate --prefix` names the library
and trains the same; a prefix that is no C name, or clashes with the library, is refused.

Split from test_firmware_library.py (one library per storage against PyTorch): these builds took a
third of that module's time, and with ``--dist loadfile`` one long file keeps one worker busy alone.
"""

from __future__ import annotations

import subprocess

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("unicorn")
pytest.importorskip("ziglang")

from test_firmware_library import LIBRARY, SHAPE, _generate  # noqa: E402

from poet_opt.errors import PoetError  # noqa: E402
from poet_opt.examples.torch_models import tiny_cnn  # noqa: E402
from poet_opt.firmware.build import BOARD_DIR, build_firmware, common_cflags  # noqa: E402
from poet_opt.firmware.emulator import Emulator  # noqa: E402
from poet_opt.firmware.toolchain import WARNING_FLAGS, zig_cc  # noqa: E402
from poet_opt.firmware.trainer import KERNEL_DIR  # noqa: E402


def _global_definitions(obj) -> list[str]:
    from elftools.elf.elffile import ELFFile

    with open(obj, "rb") as fh:
        symtab = ELFFile(fh).get_section_by_name(".symtab")
        return [s.name for s in symtab.iter_symbols()
                if s["st_info"]["bind"] == "STB_GLOBAL" and s["st_shndx"] != "SHN_UNDEF"]


def test_two_prefixes_link_into_one_image_and_train_side_by_side(tmp_path):
    """Each library exports only names with its prefix, so two models share one image."""
    libs = {}
    for prefix, ram in (("kws_", "48KiB"), ("vww_", "40KiB")):
        libs[prefix] = _generate(tiny_cnn(), "nrf52840", ram, tmp_path / prefix, prefix=prefix)
        target = libs[prefix][3]
        obj = tmp_path / f"{prefix}.o"
        done = subprocess.run([*zig_cc(), *common_cflags(target), *WARNING_FLAGS, f"-I{KERNEL_DIR}", "-c",
                               str(tmp_path / prefix / f"{prefix}train.c"), "-o", str(obj)],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        names = _global_definitions(obj)
        assert names and all(name.startswith(prefix) for name in names), names
    (tmp_path / "both.c").write_text("""
#include <stdint.h>
#include "kws_/kws_train.h"
#include "vww_/vww_train.h"
static float inputs[KWS_INPUT_FLOATS];
static const int32_t labels[KWS_BATCH];
__attribute__((used)) float both_losses[2];
int main(void)
{
    int rc = (int)kws_init() | (int)vww_init();
    rc |= (int)kws_train_step(inputs, labels, 0.05f, &both_losses[0]);
    rc |= (int)vww_train_step(inputs, labels, 0.05f, &both_losses[1]);
    return rc;
}
""")
    firmware = build_firmware([tmp_path / "kws_" / "kws_train.c", tmp_path / "vww_" / "vww_train.c",
                               tmp_path / "both.c", *LIBRARY], target, tmp_path, name="both",
                              # no -I of a temporary directory: it would key zig's cache of the kernel
                              # objects apart from every other build's, and compile them again (7 s)
                              include_dirs=[KERNEL_DIR, BOARD_DIR],
                              defines=target.storage_defines(), min_stack_bytes=4096,
                              arena_sections=[".kws_arena", ".vww_arena"])
    emulator = Emulator(firmware)
    result = emulator.run()
    losses = emulator.read_symbol("both_losses", np.float32)
    emulator.close()
    assert result.exit_code == 0
    # the same module planned at two budgets: both train to torch's loss on the same batch
    module = tiny_cnn()
    expected = torch.nn.functional.cross_entropy(module(torch.zeros(SHAPE)), torch.zeros(SHAPE[0]).long()).item()
    np.testing.assert_allclose(losses, [expected] * 2, rtol=1e-5)


@pytest.mark.parametrize("prefix, why", [("9x_", "C identifier"), ("a-b", "C identifier"), ("", "C identifier"),
                                         ("POET_STORAGE_", "POET_STORAGE_OK")])
def test_a_prefix_that_is_no_c_name_or_clashes_with_the_library_is_refused(prefix, why):
    from poet_opt.firmware.library import check_library_prefix

    with pytest.raises(PoetError, match=why):
        check_library_prefix(prefix)
    check_library_prefix("poet_page_")  # poet_page_in and _out are the library's; poet_page_init is not


SMALL = "import torch\nfrom torch import nn\n\ndef make():\n    torch.manual_seed(0)\n    " \
        "return nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))\n"


def _emulate_small(tmp_path, *extra):
    import json

    from test_cli import cli

    (tmp_path / "small.py").write_text(SMALL)
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "b.npz", x=rng.standard_normal((2, 16)).astype(np.float32), y=np.array([1, 3]))
    result = cli("emulate", "--torch", f"{tmp_path / 'small.py'}:make", "--input-shape", "2,16", "--device",
                 "stm32f746", "--ram", "16KiB", "--steps", 2, "--lr", 0.05, "--data", tmp_path / "b.npz", "--json",
                 "-q", *extra)
    return result, (json.loads(result.stdout) if result.exit_code == 0 else None)


def test_emulate_prefix_names_the_library_and_trains_the_same(tmp_path):
    plain, plain_summary = _emulate_small(tmp_path, "-o", tmp_path / "plain")
    named, named_summary = _emulate_small(tmp_path, "--prefix", "kws_", "-o", tmp_path / "kws")
    assert plain.exit_code == 0 and named.exit_code == 0, named.stderr
    assert named_summary["loss"] == plain_summary["loss"]
    made = {p.name for p in (tmp_path / "kws").iterdir()}
    assert {"kws_train.c", "kws_train.h", "poet_harness.c", "poet_train.elf", "poet_train.ld"} <= made
    assert "poet_train.c" not in made
    harness = (tmp_path / "kws" / "poet_harness.c").read_text()
    assert '#include "kws_train.h"' in harness and "kws_train_step(" in harness
    script = (tmp_path / "kws" / "poet_train.ld").read_text()
    assert "KEEP(*(.kws_arena))" in script
    assert script.startswith("/*\n * poet_train.ld") and "do not edit" in script[:script.index("*/")]


def test_emulate_refuses_a_prefix_that_is_no_c_name_before_solving(tmp_path):
    from test_cli import assert_one_line_error

    result, _ = _emulate_small(tmp_path, "--prefix", "9lives", "-o", tmp_path / "out")
    assert_one_line_error(result, "--prefix", "9lives")
    assert not (tmp_path / "out").exists()
