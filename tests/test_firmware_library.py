"""The generated training step is a library: a C harness compiled against ``<prefix>train.h`` alone
(no generated main) trains on batches it passes in, predicts, and keeps its weights across a reset
(issue 29, item 1). Its predict is PyTorch's eval mode: batch norm normalises with the running
statistics training moved, for whole tensors and for activation strips alike."""

from __future__ import annotations

import copy
import subprocess

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("unicorn")
pytest.importorskip("ziglang")

from poet_opt.device.profiles import load_profile  # noqa: E402
from poet_opt.examples.torch_models import strip_cnn, tiny_cnn  # noqa: E402
from poet_opt.firmware import codegen  # noqa: E402
from poet_opt.firmware.build import BOARD_DIR, build_firmware, common_cflags  # noqa: E402
from poet_opt.firmware.emulator import Emulator  # noqa: E402
from poet_opt.firmware.fit import solve_for_export  # noqa: E402
from poet_opt.firmware.library import running_statistics  # noqa: E402
from poet_opt.firmware.targets import target_from_profile  # noqa: E402
from poet_opt.firmware.toolchain import WARNING_FLAGS, zig_cc  # noqa: E402
from poet_opt.firmware.trainer import KERNEL_DIR  # noqa: E402
from poet_opt.model.network import lower_network  # noqa: E402

K, LR, SHAPE = 3, 0.05, (2, 3, 16, 16)
LIBRARY = [*(KERNEL_DIR / n for n in codegen.KERNEL_FILES), *(BOARD_DIR / n for n in codegen.PAGING_FILES)]

# init, then by test_mode: 0 trains K steps on the K batches the host wrote, saves, predicts; 1 loads
# and predicts; 2 predicts with the weights the image starts with; 3 records statuses. Predicting is
# of test_other (batch 0's first sample beside other samples), then of batch 0
HARNESS = """
#include <stdint.h>
#include "poet_train.h"

#define K {k}u
__attribute__((used)) float test_inputs[K * POET_INPUT_FLOATS];
__attribute__((used)) int32_t test_labels[K * POET_BATCH];
__attribute__((used)) float test_losses[K];
__attribute__((used)) float test_logits[POET_LOGITS_FLOATS];
__attribute__((used)) float test_other[POET_INPUT_FLOATS];
__attribute__((used)) float test_logits_other[POET_LOGITS_FLOATS];
__attribute__((used)) int32_t test_mode;
__attribute__((used)) int32_t test_status[5];

int main(void)
{{
    uint32_t k;
    poet_status rc;
    if (test_mode == 3) {{
        int32_t bad[POET_BATCH];
        for (k = 0u; k < POET_BATCH; ++k) {{
            bad[k] = (int32_t)POET_CLASSES;
        }}
        test_status[0] = poet_train_step(test_inputs, test_labels, {lr}f, &test_losses[0]);
        test_status[1] = poet_init();
        test_status[2] = poet_load_weights();
        test_status[3] = poet_train_step(test_inputs, bad, {lr}f, &test_losses[0]);
        test_status[4] = poet_train_step(test_inputs, test_labels, 0.0f, &test_losses[0]);
        return 0;
    }}
    rc = poet_init();
    if (rc != POET_OK) {{
        return 100;
    }}
    if (test_mode == 0) {{
        for (k = 0u; k < K; ++k) {{
            rc = poet_train_step(test_inputs + k * POET_INPUT_FLOATS, test_labels + k * POET_BATCH, {lr}f,
                                 &test_losses[k]);
            if (rc != POET_OK) {{
                return 200 + (int)k;
            }}
        }}
        rc = poet_save_weights();
        if (rc != POET_OK) {{
            return 300;
        }}
    }} else if (test_mode == 1) {{
        rc = poet_load_weights();
        if (rc != POET_OK) {{
            return 400;
        }}
    }}
    rc = poet_predict(test_other, test_logits_other);
    if (rc != POET_OK) {{
        return 500;
    }}
    return (int)poet_predict(test_inputs, test_logits);
}}
""".format(k=K, lr=LR)


def _generate(module, device: str, ram: str, out, *, prefix: str = "poet_", mode: str = "joint",
              weights: str = "resident", shape=SHAPE, strips=None):
    profile = load_profile(device)
    network = lower_network(module, shape, trainable="all", weights=weights, strips=strips)
    plan = solve_for_export(network.graph, profile, ram=ram, time_limit=10, mode=mode)
    x = np.zeros(shape, np.float32)
    y = np.zeros(shape[0], np.int64)
    target = target_from_profile(profile)
    gen = codegen.generate(network, plan.schedule.to_dict(), plan.arena, plan.flash, steps=1, lr=LR, x=x, y=y,
                           prefix=prefix, storage_defines=target.storage_defines())
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{prefix}train.c").write_text(gen.source)
    (out / f"{prefix}train.h").write_text(gen.header)
    return network, plan, gen, target


# a strip plan is forced at a small size (strips=2 at every height) to keep the emulation short
@pytest.fixture(scope="module", params=[("nrf52840", "24KiB", "paging", "resident", None),
                                        ("stm32f746", "20KiB", "joint", "resident", None),
                                        ("nrf52840", "24KiB", "joint", "streamed", None),
                                        ("nrf52840", "48KiB", "joint", "streamed", 2)],
                ids=["sd-card", "nor-flash", "streamed", "strips"])
def library(request, tmp_path_factory):
    device, ram, mode, weights, strips = request.param
    out = tmp_path_factory.mktemp(f"lib-{device}")
    module, shape = (tiny_cnn(), SHAPE) if strips is None else (strip_cnn(), (2, 1, 16, 16))
    reference = copy.deepcopy(module)
    network, plan, gen, target = _generate(module, device, ram, out, mode=mode, weights=weights, shape=shape,
                                           strips=strips)
    assert bool(network.graph.meta.get("strips")) == (strips is not None)
    assert "int main" not in gen.source and "main(" not in gen.header
    (out / "test_harness.c").write_text(HARNESS)
    # `out` needs no -I (its sources find poet_train.h beside them), and a temporary directory on
    # the command line would key zig's cache of the kernels' objects apart from every other
    # build's: each fixture would compile them again (7 s), where the emulate builds reuse them
    firmware = build_firmware([out / "poet_train.c", out / "test_harness.c", *LIBRARY], target, out,
                              name="lib_test", include_dirs=[KERNEL_DIR, BOARD_DIR],
                              defines=target.storage_defines(), min_stack_bytes=4096)
    rng = np.random.default_rng(7)
    xs = rng.standard_normal((K, *shape)).astype(np.float32)
    ys = rng.integers(0, 4, size=(K, shape[0])).astype(np.int32)
    other = (2.0 + 3.0 * rng.standard_normal(shape)).astype(np.float32)  # statistics far from batch 0's
    other[0] = xs[0][0]
    return dict(network=network, plan=plan, gen=gen, firmware=firmware, reference=reference, xs=xs, ys=ys,
                other=other)


def _run(lib, mode: int, storage=None):
    gen, flash = lib["gen"], lib["plan"].flash
    emulator = Emulator(lib["firmware"], storage=storage)
    if storage is None:  # streamed weights: the storage provisioned as a board's would be
        for node, layer in gen.param_layers.items():
            emulator.storage.load(flash.offsets[node], codegen.packed_params(layer))
    emulator.write_symbol("test_inputs", lib["xs"])
    emulator.write_symbol("test_labels", lib["ys"])
    emulator.write_symbol("test_other", lib["other"])
    emulator.write_symbol("test_mode", np.array([mode], np.int32))
    result = emulator.run()
    weights = {}
    for p in lib["network"].trainable_parameters:
        if gen.param_layers:
            node, layer = next((n, layer) for n, layer in gen.param_layers.items()
                               if any(q is p for q in layer.params.values()))
            packed = np.frombuffer(emulator.storage.dump(flash.offsets[node], 4 * codegen.packed_params(layer).size),
                                   np.float32)
            before = 0
            for q in layer.params.values():
                if q is p:
                    break
                before += q.value.size
            weights[p.torch_name] = packed[before:before + p.value.size].copy()
        else:
            weights[p.torch_name] = emulator.read_symbol(gen.param_symbols[p.torch_name], np.float32)[:p.value.size]
    out = dict(exit=result.exit_code, logits=emulator.read_symbol("test_logits", np.float32).copy(),
               logits_other=emulator.read_symbol("test_logits_other", np.float32).copy(),
               running=running_statistics(emulator, lib["network"]),
               losses=emulator.read_symbol("test_losses", np.float32).copy(),
               status=emulator.read_symbol("test_status", np.int32).copy(), weights=weights,
               storage=emulator.storage, violations=list(result.storage.violations),
               written=int(result.storage.bytes_written))
    emulator.close()
    return out


def _torch_sgd(lib):
    module = copy.deepcopy(lib["reference"])  # each test trains its own copy from the initial weights
    module.train()
    opt = torch.optim.SGD(module.parameters(), lr=LR)
    losses = []
    for x, y in zip(lib["xs"], lib["ys"]):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(module(torch.from_numpy(x)), torch.from_numpy(y).long())
        loss.backward()
        opt.step()
        losses.append(loss.item())
    module.eval()  # what the firmware's predict is: batch norm with the running statistics
    with torch.no_grad():
        logits = module(torch.from_numpy(lib["xs"][0])).numpy()
        single = module(torch.from_numpy(lib["xs"][0][:1])).numpy()
    return module, losses, logits, single


@pytest.fixture(scope="module")
def trained(library):
    return _run(library, 0)


def test_k_steps_on_batches_the_harness_passes_equal_torch_sgd_and_predict_gives_torchs_logits(library, trained):
    assert trained["exit"] == 0 and not trained["violations"]
    module, losses, logits, _ = _torch_sgd(library)
    np.testing.assert_allclose(trained["losses"], losses, rtol=1e-5)
    assert len(set(np.round(losses, 4))) == K  # three batches, three different losses
    params = dict(module.named_parameters())
    largest = max(float(p.detach().abs().max()) for p in params.values())
    for name, value in trained["weights"].items():
        diff = np.abs(value - params[name].detach().numpy().reshape(-1)).max()
        assert diff <= 1e-4 * largest, (name, diff)
    scale = float(np.abs(logits).max())
    np.testing.assert_allclose(trained["logits"].reshape(logits.shape), logits, rtol=0, atol=1e-4 * scale)


def test_predict_is_eval_mode_with_the_running_statistics_training_moved(library, trained):
    """After K steps on different batches the running statistics are torch's, and predict gives
    model.eval()'s logits: for batch 0, and for its first sample alone, whatever shares its batch."""
    module, _, logits, single = _torch_sgd(library)
    buffers = {n: b.numpy() for n, b in module.named_buffers() if n.endswith(("running_mean", "running_var"))}
    assert buffers and set(trained["running"]) == set(buffers)
    moved = 0.0
    for name, want in buffers.items():
        initial = 0.0 if name.endswith("mean") else 1.0
        assert np.abs(want - initial).max() > 1e-3, name  # training moved them
        diff = float(np.abs(trained["running"][name] - want).max())
        moved = max(moved, diff)
        assert diff <= 1e-4 * max(1.0, float(np.abs(want).max())), (name, diff)
    scale = float(np.abs(logits).max())
    got = trained["logits"].reshape(logits.shape)
    worst = float(np.abs(got - logits).max())
    print(f"\npredict vs torch eval(): max |diff| {worst:.3g} ({worst / scale:.3g} of the largest logit); "
          f"running statistics max |diff| {moved:.3g}")
    assert worst <= 1e-4 * scale
    other = trained["logits_other"].reshape(logits.shape)
    np.testing.assert_array_equal(other[0], got[0])  # one sample's logits do not depend on its batch
    assert np.abs(single[0] - other[0]).max() <= 1e-4 * scale
    with torch.no_grad():  # in train mode the other samples would change the first one's logits
        module.train()
        mixed = module(torch.from_numpy(library["other"])).numpy()
    assert np.abs(mixed[0] - logits[0]).max() > 1e-3 * scale
    source = library["gen"].source
    forward = source[source.index("static int poet_forward"):]
    forward = forward[:forward.index("\n}\n")]
    assert "poet_batchnorm_eval_forward" in forward
    assert "poet_batchnorm_forward(" not in forward and "poet_batchnorm_strip_" not in forward


def test_saved_weights_survive_a_reset_and_give_the_same_predictions(library, trained):
    """A fresh emulator on the same storage (a power cycle): load then predict gives the logits the
    trained run predicted; without the load, the image's initial weights predict something else."""
    loaded = _run(library, 1, storage=trained["storage"])
    assert loaded["exit"] == 0 and not loaded["violations"]
    np.testing.assert_array_equal(loaded["logits"], trained["logits"])
    for name, value in trained["weights"].items():
        np.testing.assert_array_equal(loaded["weights"][name], value)
    assert trained["running"] and set(loaded["running"]) == set(trained["running"])
    for name, value in trained["running"].items():  # save_weights keeps batch norm's running statistics
        np.testing.assert_array_equal(loaded["running"][name], value)
    fresh = _run(library, 2, storage=trained["storage"])
    assert fresh["exit"] == 0
    assert trained["written"] > 0 and fresh["written"] == 0  # predicting pages out nothing it need not
    # resident weights start from the image's initial values; streamed ones live on the storage, but
    # the running statistics predict reads are in RAM, the image's initial ones until a load
    assert np.abs(fresh["logits"] - trained["logits"]).max() > 1e-3


def test_statuses_name_what_went_wrong(library):
    """Before init, loading from a storage no save wrote, a label past the classes, a zero rate."""
    status = _run(library, 3)["status"]
    header = library["gen"].header
    values = {name: int(header.split(f"POET_{name} = ")[1].split(",")[0].split(" ")[0])
              for name in ("OK", "E_NOT_INITIALIZED", "E_NO_SAVED_WEIGHTS", "E_LABEL", "E_ARGUMENT")}
    assert status.tolist() == [values["E_NOT_INITIALIZED"], values["OK"], values["E_NO_SAVED_WEIGHTS"],
                               values["E_LABEL"], values["E_ARGUMENT"]]
    assert len(set(values.values())) == 5


def test_the_arena_is_aligned_in_its_own_section_and_every_file_says_where_it_came_from(library):
    from poet_opt.firmware.build import ElfImage
    from poet_opt.firmware.library import schedule_sha256

    gen, plan = library["gen"], library["plan"]
    image = ElfImage.load(library["firmware"].elf_path)
    arena = image.symbols["poet_arena"]
    assert arena.address % max(4, plan.arena.alignment) == 0
    assert image.sections[".poet_arena"] >= plan.arena.arena_bytes
    assert f'section(".poet_arena")' in gen.source
    digest = schedule_sha256(plan.schedule.to_dict())
    for text in (gen.source, gen.header, gen.harness):
        head = text[:text.index("*/")]
        assert "do not edit" in head and digest in head and "poet-opt 0." in head
        assert plan.schedule.to_dict()["device"]["name"] in head and "budgets: RAM" in head
    # what a board must define for its storage, as the emulator defined it
    defines = library["firmware"].target.storage_defines()
    for key, value in defines.items():
        assert f"-D{key}={value}" in gen.source


def test_the_application_in_docs_firmware_md_compiles_against_the_header_alone(library, tmp_path):
    """docs/firmware.md's example main(), as written, strictly, with nothing but a generated header."""
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "firmware.md").read_text()
    section = doc[doc.index("## The library"):doc.index("## Taking it to a board")]
    example = next(block for block in re.findall(r"```c\n(.*?)```", section, re.S) if "int main" in block)
    (tmp_path / "poet_train.h").write_text(library["gen"].header)
    (tmp_path / "app.c").write_text(example)
    target = library["firmware"].target
    done = subprocess.run([*zig_cc(), *common_cflags(target), *WARNING_FLAGS, f"-I{tmp_path}", "-c",
                           str(tmp_path / "app.c"), "-o", str(tmp_path / "app.o")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    undefined = _undefined(tmp_path / "app.o")
    assert {"poet_init", "poet_train_step", "poet_save_weights", "poet_load_weights", "poet_predict",
            "next_batch"} <= set(undefined)


def _undefined(obj) -> list[str]:
    from elftools.elf.elffile import ELFFile

    with open(obj, "rb") as fh:
        symtab = ELFFile(fh).get_section_by_name(".symtab")
        return [s.name for s in symtab.iter_symbols() if s.name and s["st_shndx"] == "SHN_UNDEF"]
