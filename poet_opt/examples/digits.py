"""Fine-tuning on real data: scikit-learn's bundled digits (docs/firmware.md, "Fine-tuning on digits").

``python -m poet_opt.examples.digits`` pretrains :class:`DigitsCnn` with PyTorch on the digits 0-4
and writes, in the working directory:

- ``digits-cnn.npz``: the pretrained weights (PyTorch's parameter names), which
  ``--torch poet_opt.examples.digits:pretrained_cnn`` loads from the working directory (a factory
  takes no argument, so the path is fixed; run the commands from one directory);
- ``digits-train.npz`` and ``digits-eval.npz``: the digits 5-9 to fine-tune on and a held-out part
  to measure accuracy on, x (N, 1, 8, 8) float32 in [0, 1] and y the digit itself (the head has
  10 outputs, so a label is its digit and no mapping is needed).

The images are load_digits' 1,797 8x8 images, which the scikit-learn wheel ships: nothing is
downloaded. Everything follows from ``--seed``: the split and the pretraining's order and
initial weights.

The network has no batch norm. The firmware's ``predict`` is PyTorch's eval mode (batch norm with
the running statistics), so a batch-norm network's accuracy on the board would be its eval-mode
accuracy in PyTorch all the same.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
from torch import nn

from poet_opt.errors import PoetError
from poet_opt.files import write_atomic

WEIGHTS_FILE = "digits-cnn.npz"
TRAIN_FILE = "digits-train.npz"
EVAL_FILE = "digits-eval.npz"
PRETRAIN_DIGITS = (0, 1, 2, 3, 4)
EVAL_SAMPLES = 256  # of the 896 images of 5-9: held out from fine-tuning, 16 whole batches of 16
PRETRAIN_HELD_OUT = 0.2  # of the 901 images of 0-4: held out from pretraining, to report its accuracy
PRETRAIN_BATCH, PRETRAIN_LR = 32, 0.05
# Without it the pretrained head pushes the logits of 5-9, never seen, so far down that the first
# fine-tuning loss was 16 to 33 (SGD and Adam pretraining tried), and the first steps' large
# gradients left the network predicting one class for tens of steps: 200 steps at 0.1 reached 88 %
# on the held-out 5-9. With it the first loss is 3.8 and the same 200 steps reach 95 %.
LABEL_SMOOTHING = 0.1


class DigitsCnn(nn.Module):
    """Three 3x3 convolutions with ReLU, two 2x2 max poolings, then two linear layers: 8x8 -> 10
    logits, 5,362 parameters. Two convolutions at 4x4 after the first pooling hold more activations
    in plain training (88 KiB at batch 16) than any one step of its backward needs (64 KiB), so a
    budget between the two is met by recomputing. ``--trainable last:2`` fine-tunes the two linear
    layers only."""

    def __init__(self, classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, padding=1)
        self.relu1 = nn.ReLU()
        self.pool1 = nn.MaxPool2d(2)
        self.conv2 = nn.Conv2d(4, 16, 3, padding=1)
        self.relu2 = nn.ReLU()
        self.conv3 = nn.Conv2d(16, 16, 3, padding=1)
        self.relu3 = nn.ReLU()
        self.pool2 = nn.MaxPool2d(2)
        self.fc1 = nn.Linear(16 * 2 * 2, 32)
        self.relu4 = nn.ReLU()
        self.fc2 = nn.Linear(32, classes)

    def forward(self, x):
        x = self.pool1(self.relu1(self.conv1(x)))
        x = self.pool2(self.relu3(self.conv3(self.relu2(self.conv2(x)))))
        return self.fc2(self.relu4(self.fc1(torch.flatten(x, 1))))


def load_weights(module: nn.Module, path) -> nn.Module:
    """``module`` with the parameters saved in ``path`` (an .npz of PyTorch's names)."""
    with np.load(path, allow_pickle=False) as saved:
        state = {name: torch.from_numpy(saved[name]) for name in saved.files}
    module.load_state_dict(state)
    return module


def pretrained_cnn() -> nn.Module:
    """The factory for ``--torch``: :class:`DigitsCnn` with the weights ``python -m
    poet_opt.examples.digits`` wrote to ``digits-cnn.npz`` in the working directory."""
    path = Path(WEIGHTS_FILE)
    if not path.is_file():
        raise PoetError(f"no {WEIGHTS_FILE} in {Path.cwd()}: run `python -m poet_opt.examples.digits` there first",
                        field="--torch")
    return load_weights(DigitsCnn(), path)


def images() -> tuple[np.ndarray, np.ndarray]:
    """All 1,797 digits as x (N, 1, 8, 8) float32 in [0, 1] and y (N,) int64."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise PoetError("scikit-learn is not installed; pip install 'poet-opt[examples]'") from None
    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)[:, None]  # pixel values are 0..16
    return x, digits.target.astype(np.int64)


def split(seed: int, batch_size: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The four parts: "pretrain" and "pretrain_test" (0-4), "train" (5-9, whole batches of
    ``batch_size``) and "eval" (5-9, EVAL_SAMPLES held out)."""
    x, y = images()
    order = np.random.default_rng(seed).permutation(y.size)
    low = order[np.isin(y[order], PRETRAIN_DIGITS)]
    high = order[~np.isin(y[order], PRETRAIN_DIGITS)]
    held = int(len(low) * PRETRAIN_HELD_OUT)
    train = high[EVAL_SAMPLES:]
    train = train[:len(train) // batch_size * batch_size]
    if len(train) == 0:
        raise PoetError(f"{batch_size} is more than the {len(high) - EVAL_SAMPLES} fine-tuning images",
                        field="--batch-size")
    parts = {"pretrain": low[held:], "pretrain_test": low[:held], "train": train, "eval": high[:EVAL_SAMPLES]}
    return {name: (x[ix], y[ix]) for name, ix in parts.items()}


def accuracy(module: nn.Module, x: np.ndarray, y: np.ndarray) -> float:
    """The fraction of (x, y) that ``module`` classifies right (it has no batch norm or dropout, so
    training and evaluation mode agree)."""
    with torch.no_grad():
        return float((module(torch.from_numpy(x)).argmax(1).numpy() == y).mean())


def pretrain(x: np.ndarray, y: np.ndarray, epochs: int, seed: int) -> DigitsCnn:
    """DigitsCnn trained with torch.optim.SGD (momentum 0.9, smoothed labels) on (x, y), shuffled each
    epoch by ``seed``."""
    threads = torch.get_num_threads()
    # one thread: at this size torch's thread pool costs more than it saves (3.5 s an epoch with
    # two threads on a busy two-core machine, 1 s with one)
    torch.set_num_threads(1)
    try:
        torch.manual_seed(seed)
        module = DigitsCnn()
        module.train()
        opt = torch.optim.SGD(module.parameters(), lr=PRETRAIN_LR, momentum=0.9)
        rng = np.random.default_rng(seed)
        for _ in range(epochs):
            order = rng.permutation(len(y))
            for k in range(0, len(y), PRETRAIN_BATCH):
                ix = order[k:k + PRETRAIN_BATCH]
                opt.zero_grad()
                nn.functional.cross_entropy(module(torch.from_numpy(x[ix])), torch.from_numpy(y[ix]),
                                            label_smoothing=LABEL_SMOOTHING).backward()
                opt.step()
    finally:  # it may run inside another program (a test, a notebook) with threads of its own
        torch.set_num_threads(threads)
    return module


def write(epochs: int, batch_size: int, seed: int, out=".") -> list[str]:
    """Pretrain and write the three files into ``out``; returns what the command prints."""
    parts = split(seed, batch_size)
    module = pretrain(*parts["pretrain"], epochs=epochs, seed=seed)
    out = Path(out)
    arrays = {WEIGHTS_FILE: {n: p.detach().numpy() for n, p in module.named_parameters()},
              TRAIN_FILE: dict(zip("xy", parts["train"])), EVAL_FILE: dict(zip("xy", parts["eval"]))}
    for name, values in arrays.items():  # an interrupted run leaves no half-written file to be read later
        write_atomic(out / name, lambda fh, values=values: np.savez(fh, **values), field=name, binary=True)
    return [
        f"pretrained DigitsCnn on {len(parts['pretrain'][1])} images of 0-4, {epochs} epoch(s): "
        f"{accuracy(module, *parts['pretrain_test']):.2%} right on {len(parts['pretrain_test'][1])} held-out ones; "
        f"{accuracy(module, *parts['eval']):.2%} on the held-out 5-9",
        f"wrote {WEIGHTS_FILE}; {TRAIN_FILE} ({len(parts['train'][1])} images of 5-9, "
        f"{len(parts['train'][1]) // batch_size} batches of {batch_size}); {EVAL_FILE} ({EVAL_SAMPLES} held out)",
    ]


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, as poet-opt's errors (argparse prints the usage first)
        self.exit(2, f"{self.prog}: error: {message}\n")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {text!r}")
    return value


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text!r}")
    return value


def main(argv=None) -> int:
    parser = _Parser(prog="python -m poet_opt.examples.digits",
                     description="Pretrain the digits CNN on 0-4 with PyTorch and write the 5-9 fine-tuning sets.")
    parser.add_argument("--epochs", type=_positive, default=10, help="pretraining epochs (default 10)")
    parser.add_argument("--batch-size", type=_positive, default=16,
                        help="the fine-tuning batch: digits-train.npz holds whole batches of it (default 16)")
    parser.add_argument("--seed", type=_seed, default=0, help="the split, shuffle and initial weights (default 0)")
    args = parser.parse_args(argv)
    try:
        lines = write(args.epochs, args.batch_size, args.seed)
    except PoetError as exc:
        print(f"{parser.prog}: error: {exc.one_line()}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:  # the files are written last, after the pretraining
        print(f"{parser.prog}: interrupted", file=sys.stderr)
        return 130
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
