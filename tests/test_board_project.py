"""The CMake project `poet-opt emulate -o DIR` writes (poet_opt/firmware/board_project.py) configures
and builds with pip's CMake and Ninja and the zig toolchain file, and its image trains on the
emulated core exactly as emulate's own build did."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("ziglang")
pytest.importorskip("unicorn")

from poet_opt.device.profiles import load_profile  # noqa: E402
from poet_opt.firmware.board_project import (  # noqa: E402
    ELF_NAME,
    EXAMPLE_LOGITS,
    EXAMPLE_LOSSES,
    EXAMPLE_STATUS,
)
from poet_opt.firmware.build import ElfImage, Firmware  # noqa: E402
from poet_opt.firmware.emulator import Emulator  # noqa: E402
from poet_opt.firmware.library import HARNESS_LOSSES  # noqa: E402
from poet_opt.firmware.targets import target_from_profile  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
# pip's cmake and ninja put their commands beside the interpreter; nothing else on PATH is needed
ENV = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
SMALL = "import torch\nfrom torch import nn\n\ndef make():\n    torch.manual_seed(0)\n    " \
        "return nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))\n"
API = ("init", "train_step", "predict", "save_weights", "load_weights")


@pytest.fixture(autouse=True)
def _needs_cmake_and_ninja():
    if shutil.which("cmake", path=str(BIN)) is None or shutil.which("ninja", path=str(BIN)) is None:
        pytest.skip("pip packages cmake and ninja (the test extra) are not installed")


def _run(command: str, cwd: Path) -> str:
    done = subprocess.run(command, shell=True, cwd=cwd, env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (command, done.stdout[-3000:], done.stderr[-3000:])
    return done.stdout + done.stderr


def _run_elf(elf: Path, device: str, *symbols: tuple[str, type]):
    emulator = Emulator(Firmware.from_elf(elf, target_from_profile(load_profile(device))))
    try:
        result = emulator.run()
        return result, [emulator.read_symbol(name, dtype) for name, dtype in symbols], set(ElfImage.load(elf).symbols)
    finally:
        emulator.close()


def test_the_board_project_in_docs_firmware_md_builds_and_trains_as_emulate_did(tmp_path):
    doc = (ROOT / "docs" / "firmware.md").read_text()
    section = doc[doc.index("### A board project"):]
    block = re.search(r"```sh\n(.*?)```", section, re.S).group(1)
    commands = [line for line in block.splitlines() if line.strip()]
    assert [c.split()[0] for c in commands] == ["python", "poet-opt", "cmake", "cmake"]
    printed = [_run(command, tmp_path) for command in commands]
    # the project builds warning-free as the library promises, with the zig toolchain file
    assert "warning:" not in printed[3], printed[3]
    board = tmp_path / "board"
    assert (board / "cmake" / "zig-cc.cmake").is_file() and os.access(board / "cmake" / "zig-cc", os.X_OK)

    emulated, (harness_losses,), _ = _run_elf(board / "poet_train.elf", "nrf52840", (HARNESS_LOSSES, np.float32))
    built, (losses, logits, status), symbols = _run_elf(
        board / "build" / ELF_NAME, "nrf52840",
        (EXAMPLE_LOSSES, np.float32), (EXAMPLE_LOGITS, np.float32), (EXAMPLE_STATUS, np.int32))
    assert built.exit_code == 0 and int(status[0]) == 0
    assert {f"poet_{name}" for name in API} <= symbols
    # the same sources, flags and linker script: the same arithmetic to the last bit
    assert losses.tolist() == harness_losses.tolist() and len(losses) == 2
    shown = re.search(r"loss\s+([\d.]+), ([\d.]+)", printed[1])
    assert [f"{v:.5f}" for v in losses] == list(shown.groups())
    assert logits.shape == (4,) and np.isfinite(logits).all() and np.abs(logits).max() > 0
    # save_weights reached the storage: emulate's own main() never calls it
    assert built.storage.bytes_written > 0 and emulated.storage.bytes_written == 0


def _emulate_mlp(tmp_path, board):
    from test_cli import cli

    (tmp_path / "small.py").write_text(SMALL)
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "b.npz", x=rng.standard_normal((2, 16)).astype(np.float32), y=np.array([1, 3]))
    return cli("emulate", "--torch", f"{tmp_path / 'small.py'}:make", "--input-shape", "2,16", "--device",
               "stm32f746", "--ram", "16KiB", "--steps", 3, "--lr", 0.05, "--data", tmp_path / "b.npz", "-q",
               "--prefix", "kws_", "-o", board)


def test_an_mlp_project_for_the_stm32f746_builds_with_the_stub_port_which_stops_at_save(tmp_path):
    board = tmp_path / "mlp"
    result = _emulate_mlp(tmp_path, board)
    assert result.exit_code == 0, result.stderr

    gcc = (board / "cmake" / "arm-none-eabi.cmake").read_text()
    assert "-mcpu=cortex-m7 -mthumb -mfpu=fpv5-sp-d16 -mfloat-abi=hard" in gcc
    cmake = (board / "CMakeLists.txt").read_text()
    # the profile's QSPI NOR flash: 64 KiB sectors, erased before programming
    assert "kws_train.c" in cmake and 'set(POET_STORAGE_ERASE_REQUIRED "1"' in cmake
    assert 'set(POET_STORAGE_ERASE_BLOCK_BYTES "65536u"' in cmake
    assert "POET_STORAGE_ERASE_BLOCK_BYTES = 65536u" in (board / "poet_storage_port.c").read_text()
    assert "do not edit" in cmake.splitlines()[0] + cmake.splitlines()[1]
    readme = (board / "README.md").read_text()
    steps = [readme.index(f"{k}. **") for k in range(1, 5)]
    assert steps == sorted(steps) and "poet_storage_port.c" in readme[steps[1]:steps[2]]

    _run(f'cmake -S "{board}" -B "{board / "build"}" -G Ninja -DCMAKE_TOOLCHAIN_FILE=cmake/zig-cc.cmake', tmp_path)
    _run(f'cmake --build "{board / "build"}"', tmp_path)
    built, (losses, status), symbols = _run_elf(board / "build" / ELF_NAME, "stm32f746",
                                                (EXAMPLE_LOSSES, np.float32), (EXAMPLE_STATUS, np.int32))
    assert {f"kws_{name}" for name in API} <= symbols
    # the stub fails every storage call: training and predict ran, save_weights reports the port's error
    assert np.isfinite(losses).all() and losses[-1] < losses[0]
    assert int(status[0]) == -4 == built.exit_code

    # a rerun regenerates the project but keeps the driver the user filled in
    port = board / "poet_storage_port.c"
    port.write_text(port.read_text() + "/* my driver */\n")
    (board / "CMakeLists.txt").write_text("# poet-opt's, stale\n")
    rerun = _emulate_mlp(tmp_path, board)
    assert rerun.exit_code == 0, rerun.stderr
    assert port.read_text().endswith("/* my driver */\n") and "kws_train.c" in (board / "CMakeLists.txt").read_text()


def test_a_directory_whose_project_files_are_someone_elses_is_refused_before_solving(tmp_path):
    from test_cli import assert_one_line_error

    board = tmp_path / "mine"
    board.mkdir()
    (board / "CMakeLists.txt").write_text("project(mine C)\n")
    assert_one_line_error(_emulate_mlp(tmp_path, board), "-o", "CMakeLists.txt", "not written by poet-opt")
    assert (board / "CMakeLists.txt").read_text() == "project(mine C)\n" and not (board / "kws_train.c").exists()
