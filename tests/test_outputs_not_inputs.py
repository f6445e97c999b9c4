"""No command writes over one of its inputs, nor through a link it did not create (issue 28, 2):
`emulate -o DIR` keeps a dozen files in DIR, each checked against every input (--data, --device,
--torch, --weights-out) by device and inode before the solve, and each renamed into place."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from poet_opt.cli import main
from poet_opt.device.profiles import PROFILE_DIR
from poet_opt.files import check_not_inputs
from poet_opt.errors import PoetError

MODEL = """
import torch
from torch import nn


def make():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))
"""


@pytest.fixture
def inputs(tmp_path):
    (tmp_path / "model.py").write_text(MODEL)
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "batch.npz", x=rng.standard_normal((2, 16)).astype(np.float32), y=np.array([1, 3]))
    (tmp_path / "out").mkdir()
    return tmp_path


def emulate(where: Path, *, data="batch.npz", device="stm32f746", extra=()):
    return CliRunner().invoke(main, [
        "emulate", "--torch", f"{where / 'model.py'}:make", "--input-shape", "2,16", "--device", str(device),
        "--ram", "16KiB", "--steps", "2", "--lr", "0.05", "--data", str(where / data), "-o", str(where / "out"),
        "--json", "-q", *extra])


def refused(result, *needles):
    assert result.exit_code == 2, (result.exit_code, result.stderr)
    line, = result.stderr.splitlines()
    assert "Traceback" not in result.stderr and result.stdout == ""
    for needle in needles:
        assert needle in line, line


def test_data_inside_the_output_directory_is_not_overwritten(inputs):
    shutil.copy(inputs / "batch.npz", inputs / "out" / "poet_train.c")
    before = (inputs / "out" / "poet_train.c").read_bytes()
    refused(emulate(inputs, data="out/poet_train.c"), "poet_train.c", "-o", "--data")
    assert (inputs / "out" / "poet_train.c").read_bytes() == before


def test_a_profile_inside_the_output_directory_is_not_overwritten(inputs):
    profile = inputs / "out" / "poet_storage.h"
    shutil.copy(PROFILE_DIR / "stm32f746.yaml", profile)
    before = profile.read_bytes()
    refused(emulate(inputs, device=profile), "poet_storage.h", "--device")
    assert profile.read_bytes() == before


def test_a_hard_link_to_the_data_is_the_data(inputs):
    os.link(inputs / "batch.npz", inputs / "out" / "poet_train.elf")
    refused(emulate(inputs), "poet_train.elf", "--data")
    np.load(inputs / "batch.npz")  # still the batch


def test_weights_out_onto_the_kept_image_is_refused(inputs):
    refused(emulate(inputs, extra=["--weights-out", str(inputs / "out" / "poet_train.elf")]),
            "--weights-out", "-o")
    assert not (inputs / "out" / "poet_train.elf").exists()


def test_a_symlink_in_the_output_directory_is_replaced_not_followed(inputs):
    victim = inputs / "victim.json"
    victim.write_text('{"keep": true}')
    (inputs / "out" / "poet_math.c").symlink_to("../victim.json")
    result = emulate(inputs)
    assert result.exit_code == 0, result.stderr
    assert victim.read_text() == '{"keep": true}'
    kept = inputs / "out" / "poet_math.c"
    assert not kept.is_symlink() and "poet" in kept.read_text()
    assert len(json.loads(result.stdout)["loss"]) == 2
    assert not [p for p in (inputs / "out").iterdir() if p.name.startswith(".")]  # no temporaries left


def test_write_files_refuses_an_input_before_writing_anything(tmp_path):
    from poet_opt.files import write_files

    (tmp_path / "b.txt").write_text("input")
    with pytest.raises(PoetError) as info:
        write_files(tmp_path, {"a.txt": b"new", "b.txt": b"new"}, field="-o", inputs=[("--data", tmp_path / "b.txt")])
    assert info.value.field == "-o" and "--data" in info.value.message
    assert not (tmp_path / "a.txt").exists() and (tmp_path / "b.txt").read_text() == "input"


def test_identity_not_spelling_decides(tmp_path):
    (tmp_path / "g.json").write_text("{}")
    (tmp_path / "sub").mkdir()
    spelled = tmp_path / "sub" / ".." / "g.json"
    with pytest.raises(PoetError):
        check_not_inputs([("--out", spelled)], [("--graph", tmp_path / "g.json")])
    (tmp_path / "link.json").symlink_to(tmp_path / "g.json")
    with pytest.raises(PoetError):
        check_not_inputs([("--out", tmp_path / "g.json")], [("--graph", tmp_path / "link.json")])
    check_not_inputs([("--out", tmp_path / "new.json")], [("--graph", tmp_path / "g.json")])
