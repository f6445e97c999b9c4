"""The operator registry: one place per operator says what every stage needs to know about it.

A training graph names each node's operator by a string (``Node.op``: "conv2d", "relu", ...). What
that string means is an :class:`OpSpec`, registered by the module of its family (``activations``,
``conv``, ``pool``, ``norm``, ``linear``, ``attention``, ``structure``) and looked up here: its
names in PyTorch and ONNX (the importers), its FLOP rule and what its backward reads (the graph),
how it tiles (activation strips, row tiles, weight slices), its PyTorch reference (the executor)
and the names of its C kernels (the firmware generator; strings, since the model stage cannot
import the firmware stage). Adding an operator is one entry here, its C kernels and a test
(docs/architecture.md, "Adding an operator"); ``python -m poet_opt.model.ops`` prints the support
table docs/operators.md holds.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable, Iterable

# How an operator's output can be cut so that a node computes a piece of it:
SPLITS = {
    "elementwise": "each output element reads the same element of its inputs: strip by strip and token by token",
    "window": "a convolution or pooling window along H: a strip reads the input rows under its windows (halo)",
    "reduction": "statistics over the tensor: pieces chain partial statistics, then each piece is normalised",
    "tokenwise": "each token (row) is independent, its features are not: row blocks, never feature pieces",
    "channels": "joins tensors along the channel axis: strip by strip along H",
    "whole": "cannot be split: every node computes the whole tensor",
}
# The tilings the graph builders implement: activation strips along H (model/strips.py), row blocks
# of tokens (model/rows.py), slices of a layer's output features (model/tiling.py).
TILINGS = ("strips", "rows", "slices")
_DEFAULT_TILINGS = {"elementwise": ("strips", "rows"), "window": ("strips",), "tokenwise": ("rows",),
                    "channels": ("strips",), "reduction": (), "whole": ()}
SAVES = ("", "in", "out", "other", "in+out")


@dataclass(frozen=True)
class OpSpec:
    name: str  # the graph's operator string (Node.op)
    family: str  # the registry module that defines it
    split: str  # a key of SPLITS
    # what back-propagating through it reads besides the output gradient (zoo._Op.saves): "in" its
    # inputs, "out" its output, "other" the other operand of a product, "" nothing, "in+out" both
    saves: str = ""
    flops_per_element: float | None = None  # forward FLOPs per output element, when that is the rule
    flop_rule: str = ""  # the rule in words, when it depends on more than the output's size
    torch_modules: tuple[str, ...] = ()  # torch.nn class names the importer lowers to it
    torch_functions: tuple[str, ...] = ()  # F.*, torch.* and Tensor method names (in-place spellings too)
    onnx: tuple[str, ...] = ()  # ONNX op types
    # the PyTorch reference: torch_forward(torch, *inputs) -> output, torch's own function;
    # torch_backward(torch, grad_out, saved) -> grad_in for an operator whose backward reads
    # ``saved`` (its output when saves == "out"); None: autograd through torch_forward
    torch_forward: Callable | None = None
    torch_backward: Callable | None = None
    # torch_backward_call(torch, grad_out, y, fn, arguments) -> grad_in: the backward from the output
    # of an operator whose formula depends on how the traced call spells it (``fn``: "rsqrt" or "sqrt")
    # or on its arguments (``arguments``: the module's attributes or the function's bound arguments,
    # elu's alpha). Only the whole-tensor executor, which runs the traced node itself, has them.
    torch_backward_call: Callable | None = None
    # C kernels (firmware/kernels/). With c_convention "elementwise" the generators call
    # c_forward(y, *inputs, n) and c_backward(dx, dy, *saved, n), saved as ``saves`` says, and
    # accumulate into dx; "own": the generators write the call themselves (a shape struct, ...)
    c_forward: str | None = None
    c_backward: str | None = None
    c_convention: str = "own"
    tilings: tuple[str, ...] | None = None  # None: as its split allows (_DEFAULT_TILINGS)
    arity: int = 1  # activation inputs; 0 for the graph's input and parameters, -1: any number
    doc: str = ""

    def __post_init__(self):
        assert self.split in SPLITS, (self.name, self.split)
        assert self.saves in SAVES, (self.name, self.saves)
        assert self.c_convention in ("elementwise", "own"), self.name
        assert self.tilings is None or set(self.tilings) <= set(TILINGS), self.name

    @property
    def tiled(self) -> tuple[str, ...]:
        """The tilings the graph builders split this operator in."""
        return self.tilings if self.tilings is not None else _DEFAULT_TILINGS[self.split]

    def torch_gradient(self, torch, grad, x=None, y=None):
        """The gradient into the input of a one-input elementwise operator, from its output's
        gradient and what its backward reads: ``y`` (its output) when saves is "out", ``x`` (its
        input) when "in", nothing when "" (linear: differentiated at zero)."""
        if self.saves == "out" and self.torch_backward is not None:
            return self.torch_backward(torch, grad, y)
        if self.torch_forward is None or self.saves not in ("in", ""):
            raise KeyError(f"{self.name}: no PyTorch reference differentiates it from what its backward reads")
        with torch.enable_grad():
            leaf = (x if self.saves == "in" else torch.zeros_like(grad)).detach().requires_grad_(True)
            (dx,) = torch.autograd.grad(self.torch_forward(torch, leaf), leaf, grad)
        return dx

    def flops(self, elements: int) -> float:
        """Forward FLOPs for an output of ``elements`` elements (operators whose rule is per element)."""
        if self.flops_per_element is None:
            raise KeyError(f"{self.name} has no per-element FLOP rule: {self.flop_rule}")
        return float(self.flops_per_element * elements)


FAMILIES = ("structure", "activations", "conv", "pool", "norm", "linear", "attention")
_REGISTRY: dict[str, OpSpec] = {}
_LOADED = False


def register(*items: OpSpec) -> None:
    """Called by each family module at import."""
    for s in items:
        if s.name in _REGISTRY:
            raise ValueError(f"operator {s.name!r} registered twice ({_REGISTRY[s.name].family}, {s.family})")
        _REGISTRY[s.name] = s


def _load() -> dict[str, OpSpec]:
    global _LOADED
    if not _LOADED:
        for family in FAMILIES:
            importlib.import_module(f"{__name__}.{family}")
        _LOADED = True
        _check_names()
    return _REGISTRY


def _check_names() -> None:
    """One operator per PyTorch or ONNX name: an importer must not have two answers."""
    for attr in ("torch_modules", "torch_functions", "onnx"):
        owner: dict[str, str] = {}
        for s in _REGISTRY.values():
            for n in getattr(s, attr):
                assert n not in owner, f"{attr} {n!r} names both {owner[n]} and {s.name}"
                owner[n] = s.name


def specs() -> tuple[OpSpec, ...]:
    """Every operator, family by family in FAMILIES order."""
    reg = _load()
    return tuple(sorted(reg.values(), key=lambda s: FAMILIES.index(s.family)))


def get(name: str) -> OpSpec | None:
    return _load().get(name)


def spec(name: str) -> OpSpec:
    found = get(name)
    if found is None:
        raise KeyError(f"no operator {name!r} in the registry")
    return found


def names(*, split: str | Iterable[str] | None = None, tiling: str | None = None, family: str | None = None,
          c_convention: str | None = None) -> tuple[str, ...]:
    """Operator names that match every filter given, in registry order."""
    splits = (split,) if isinstance(split, str) else (tuple(split) if split is not None else None)
    return tuple(s.name for s in specs() if (splits is None or s.split in splits)
                 and (tiling is None or tiling in s.tiled) and (family is None or s.family == family)
                 and (c_convention is None or s.c_convention == c_convention))


def by_torch_module(class_name: str) -> OpSpec | None:
    return next((s for s in specs() if class_name in s.torch_modules), None)


def by_torch_function(fn: str) -> OpSpec | None:
    return next((s for s in specs() if fn in s.torch_functions), None)


def by_onnx(op_type: str) -> OpSpec | None:
    return next((s for s in specs() if op_type in s.onnx), None)


def elementwise_rule(name: str, default: tuple[float, str] | None = None) -> tuple[float, str]:
    """(FLOPs per output element, what the backward reads) of a per-element operator."""
    s = get(name)
    if s is None or s.flops_per_element is None:
        if default is not None:
            return default
        raise KeyError(name)
    return s.flops_per_element, s.saves
