"""The firmware of a model of token ids outside emulate's training run (issue 27): an application's
own main() against poet_train.h passes int32 ids and gets E_TOKEN for one outside the table, and
`measure --device` profiles a step on random ids below the table.

Split from test_emulate_embedding.py (emulate trains models of token ids as torch.optim.SGD): these
two builds took half of that module's time, and with ``--dist loadfile`` one long file keeps one
worker busy alone.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("unicorn")
pytest.importorskip("ziglang")

from test_cli import cli  # noqa: E402
from test_run_embedding import bag_of_words  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


TOKEN_HARNESS = """
#include <stdint.h>
#include "poet_train.h"

static int32_t ids[POET_INPUT_IDS];
static int32_t labels[POET_BATCH];
static float logits[POET_LOGITS_FLOATS];
__attribute__((used)) volatile int32_t test_status[4];

int main(void)
{
    uint32_t i;
    float loss = 0.0f;
    poet_init();
    for (i = 0u; i < POET_INPUT_IDS; ++i)
        ids[i] = (int32_t)(i % POET_VOCABULARY);
    for (i = 0u; i < POET_BATCH; ++i)
        labels[i] = 0;
    test_status[0] = poet_train_step(ids, labels, 0.05f, &loss);
    ids[3] = (int32_t)POET_VOCABULARY;
    test_status[1] = poet_train_step(ids, labels, 0.05f, &loss);
    ids[3] = -1;
    test_status[2] = poet_predict(ids, logits);
    ids[3] = 0;
    test_status[3] = poet_predict(ids, logits);
    return 0;
}
"""


def test_the_library_takes_int32_ids_and_refuses_one_outside_the_table(tmp_path):
    """An application's own main() against poet_train.h alone: train_step and predict take
    const int32_t *, and an id outside [0, VOCABULARY) returns E_TOKEN before anything runs."""
    from test_firmware_library import LIBRARY, _generate

    from poet_opt.firmware.build import BOARD_DIR, build_firmware
    from poet_opt.firmware.emulator import Emulator
    from poet_opt.firmware.trainer import KERNEL_DIR

    _, _, gen, target = _generate(bag_of_words(), "nrf52840", "64KiB", tmp_path, shape=(2, 16))
    (tmp_path / "test_harness.c").write_text(TOKEN_HARNESS)
    firmware = build_firmware([tmp_path / "poet_train.c", tmp_path / "test_harness.c", *LIBRARY], target, tmp_path,
                              name="ids_test", include_dirs=[KERNEL_DIR, BOARD_DIR],  # as in test_firmware_library
                              defines=target.storage_defines(), min_stack_bytes=4096)
    emulator = Emulator(firmware)
    try:
        assert emulator.run().exit_code == 0
        status = emulator.read_symbol("test_status", np.int32).tolist()
    finally:
        emulator.close()
    values = {name: int(gen.header.split(f"POET_{name} = ")[1].split(",")[0].split(" ")[0])
              for name in ("OK", "E_TOKEN")}
    assert status == [values["OK"], values["E_TOKEN"], values["E_TOKEN"], values["OK"]]


def test_measure_device_profiles_a_model_of_token_ids(tmp_path):
    """`measure --device` runs one profiled step of the firmware on random ids below the table (the
    library would refuse floats with E_TOKEN) and writes a cost per node."""
    out = tmp_path / "costs.csv"
    # a 10 s limit: the plan's quality is not what this is about, and the default 60 s (two solves, the
    # second at a tightened budget) was most of the test's time
    ran = cli("measure", "--device", "nrf52840", "--torch", "poet_opt.examples.torch_models:small_token_classifier",
              "--input-shape", "1,16", "--ram", "48KiB", "--strips", "2", "--time-limit", "10", "-o", out)
    assert ran.exit_code == 0, ran.stderr
    rows = out.read_text().splitlines()
    assert rows[0] == "name,time_s,energy_j" and any(r.startswith("embed@r0@c0") for r in rows)
