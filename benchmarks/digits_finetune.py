"""The digits fine-tuning walkthrough (docs/firmware.md, "Fine-tuning on digits"), run longer: 5 epochs
(200 steps of 16) on the emulated nRF52840 at 64 KiB, all layers and the last two, and all layers
with recomputation off (--mode paging: the step pages to the SD card, and wears it), beside the same
fine-tuning in plain PyTorch (model.train(), torch.optim.SGD, the same batches in the same order).

Prints one table: accuracy on the held-out 5-9 before and after from the firmware's predict and from
PyTorch, the largest weight difference over the largest weight, the plan (recomputes, page-outs), the
energy and time per step the profile predicts beside the emulator's cycle estimate, and the storage
the run wrote (its wear). The figures are in benchmarks/FIRMWARE.md, "Fine-tuning on digits".

    python benchmarks/digits_finetune.py          # about 70 s on 2 busy cores
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from poet_opt.examples import digits  # noqa: E402
from poet_opt.firmware.trainer import emulate_training  # noqa: E402

DEVICE, RAM, BATCH, LR, EPOCHS, SEED = "nrf52840", "64KiB", 16, 0.1, 5, 0
# (layers trained, joint or paging): the same 64 KiB forces recomputation in joint mode and, with
# recomputation off, page-outs to the SD card, whose wear the walkthrough reports
CASES = [("all", "joint"), ("last:2", "joint"), ("all", "paging")]


def order(n: int, steps: int) -> list[np.ndarray]:
    """docs/firmware.md's order, written out apart from the firmware's code: epoch e takes the e-th
    permutation of numpy.random.default_rng(SEED), cut into batches."""
    rng, out = np.random.default_rng(SEED), []
    for step in range(steps):
        if step % (n // BATCH) == 0:
            perm = rng.permutation(n)
        k = step % (n // BATCH)
        out.append(perm[k * BATCH:(k + 1) * BATCH])
    return out


def torch_fine_tuning(trainable: str, x, y, ex, ey, low_test) -> dict:
    module = digits.load_weights(digits.DigitsCnn(), digits.WEIGHTS_FILE)
    module.train()
    layers = [module.fc1, module.fc2] if trainable == "last:2" else list(module.children())
    params = [p for layer in layers for p in layer.parameters()]
    for p in module.parameters():
        p.requires_grad_(any(p is q for q in params))
    before = digits.accuracy(module, ex, ey)
    opt = torch.optim.SGD(params, lr=LR)
    losses = []
    for ix in order(len(y), EPOCHS * len(y) // BATCH):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(module(torch.from_numpy(x[ix])), torch.from_numpy(y[ix]))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"before": before, "after": digits.accuracy(module, ex, ey), "losses": losses,
            "low_after": digits.accuracy(module, *low_test),
            "weights": {n: p.detach().numpy() for n, p in module.named_parameters()}}


def main() -> None:
    torch.set_num_threads(1)
    started = time.perf_counter()
    work = tempfile.mkdtemp(prefix="digits-")
    os.chdir(work)  # pretrained_cnn reads digits-cnn.npz from the working directory
    print("\n".join(digits.write(epochs=10, batch_size=BATCH, seed=SEED)))
    parts = digits.split(SEED, BATCH)
    (x, y), (ex, ey) = parts["train"], parts["eval"]
    print(f"\n{DEVICE} at {RAM}, batch {BATCH}, lr {LR}, {EPOCHS} epochs ({EPOCHS * len(y) // BATCH} steps); "
          f"accuracy on the {len(ey)} held-out images of 5-9\n")
    head = (f"{'trained':8} {'plan':>12} {'fw before':>9} {'fw after':>8} {'torch bef':>9} {'torch aft':>9} "
            f"{'max|dw|/max|w|':>14} {'pred mJ':>8} {'pred ms':>8} {'est ms':>7} {'est/pred':>8} "
            f"{'written B':>9} {'RAM KiB':>7} {'torch 0-4':>9}")
    rows = []
    for trainable, mode in CASES:
        fw = emulate_training(torch_model="poet_opt.examples.digits:pretrained_cnn", input_shape=f"{BATCH},1,8,8",
                              batch_size=BATCH, device=DEVICE, ram=RAM, steps=None, epochs=EPOCHS, lr=LR, seed=SEED,
                              data=digits.TRAIN_FILE, eval_data=digits.EVAL_FILE, trainable=trainable, time_limit=60,
                              mode=mode)
        ref = torch_fine_tuning(trainable, x, y, ex, ey, parts["pretrain_test"])
        largest = max(float(np.abs(w).max()) for w in ref["weights"].values())
        diff = max(float(np.abs(fw.weights[n] - w).max()) for n, w in ref["weights"].items() if n in fw.weights)
        s, totals = fw.summary(), fw.schedule.totals
        plan = f"{totals.get('recomputes', 0)} rec, {totals.get('page_outs', 0)} out"
        label = trainable + (" pg" if mode == "paging" else "")
        rows.append(f"{label:8} {plan:>12} {s['accuracy_before']:>9.2%} {s['accuracy_after']:>8.2%} "
                    f"{ref['before']:>9.2%} {ref['after']:>9.2%} {diff / largest:>14.1e} "
                    f"{s['predicted_energy_j_per_step'] * 1e3:>8.2f} {s['predicted_runtime_s_per_step'] * 1e3:>8.1f} "
                    f"{s['estimated_runtime_s_per_step'] * 1e3:>7.1f} {s['estimated_over_predicted']:>8.2f} "
                    f"{s['flash_bytes_written']:>9,} {s['ram_used_bytes'] / 1024:>7.1f} {ref['low_after']:>9.2%}")
        loss_diff = max(abs(a - b) for a, b in zip(fw.losses, ref["losses"]))
        lifetime = ("unlimited (nothing written)" if fw.flash_lifetime_steps is None
                    else f"{fw.flash_lifetime_steps:,} steps")
        rows.append(f"{'':8} loss: firmware {fw.losses[0]:.4f} -> {fw.losses[-1]:.4f}, torch {ref['losses'][0]:.4f} -> "
                    f"{ref['losses'][-1]:.4f}; max |loss diff| {loss_diff:.1e}; "
                    f"{fw.instructions_per_step / 1e6:.2f} M instructions a step; storage lifetime {lifetime}; "
                    f"{fw.flash_wear_events:,} allocation-unit wear event(s) in the run, "
                    f"{s['storage_bus_s_per_step'] * 1e3:.1f} ms of storage transfers a step")
    print(head)
    print("-" * len(head))
    print("\n".join(rows))
    print(f"\n{time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
