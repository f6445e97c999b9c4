"""What runs where: for every operator of the registry and every tiling, which backends execute it
and which refuse it before solving. tests/test_support_matrix.py runs every cell and checks it:
a backend said to run it must equal PyTorch, one said to refuse must raise one PoetError naming the
operator (or the option that asked for the tiling). docs/operators.md is this table, generated.

Graph and costs, the validator and the C header work on the graph alone: they run every operator
in every tiling its graph builder implements (``OpSpec.tiled``). The firmware generator and the
PyTorch executor need the operator lowered from a torch module and a kernel or reference for it:
for elementwise operators that follows from the registry entry; for the others the sets below
are the facts of today's backends, which the matrix keeps true.
"""

from __future__ import annotations

from poet_opt.model.ops import OpSpec, specs

BACKENDS = ("graph", "validator", "header", "firmware", "executor")
# the batch and streamed weights: in every graph (the weights only when streamed), no probe of their own
STRUCTURAL = ("input", "param")
TILINGS_CHECKED = ("whole", "strips", "rows", "slices")

# Elementwise operators (activations, add) follow from their registry entry: the firmware runs
# those with C kernels of the elementwise convention, whole and strip by strip; the executor runs
# one it can differentiate from what the graph keeps (its input; or its output, with a torch
# backward from it, or, whole, from it and the traced call: elu's alpha), whole when PyTorch
# spells it (it runs the traced node itself) and over strips when the registry has its PyTorch
# reference (the replay calls torch_forward); over row blocks too, where the row replay
# differentiates one operand (add routes its gradient to both).


def _elementwise(spec: OpSpec, tiling: str, backend: str) -> bool:
    if tiling not in ("whole", "strips", "rows"):
        return False
    if backend == "firmware":  # over row tiles too, where the row replay runs it (torch_rows lowers it)
        kernels = spec.c_convention == "elementwise" and spec.c_forward is not None
        return kernels and (tiling != "rows" or _elementwise(spec, "rows", "executor"))
    from_what_is_kept = spec.saves != "out" or spec.torch_backward is not None
    if tiling == "whole":  # the traced call itself: its arguments too (OpSpec.torch_backward_call)
        return (from_what_is_kept or spec.torch_backward_call is not None) and \
            bool(spec.torch_modules or spec.torch_functions)
    if tiling == "rows":
        return from_what_is_kept and spec.torch_forward is not None and (spec.arity == 1 or spec.name == "add")
    return from_what_is_kept and spec.torch_forward is not None


# Every other operator: the facts of today's backends. The firmware: what network.py lowers from a
# torch module and writer.py / strip_codegen.py / row_codegen.py have C kernels for.
FIRMWARE = {
    "whole": {"conv2d", "maxpool", "avgpool", "global_avgpool", "batchnorm", "layernorm", "linear", "matmul",
              "softmax", "embedding"},  # an embedding of the token ids the batch holds (model/batch.py)
    "strips": {"conv2d", "maxpool", "avgpool", "global_avgpool", "batchnorm", "concat"},
    "rows": {"linear", "layernorm", "matmul", "softmax", "avgpool", "embedding"},  # a torch transformer's
    # (model/torch_rows.py), tables indexed by token id or by position
    "slices": {"conv2d", "linear", "concat", "embedding"},  # a table's columns: feature pieces of every word
}
# The PyTorch executor: `poet-opt run` for whole graphs (executor/kernels.py); the strip replay
# (executor/strips.py, walked by executor/tiled.py) for strips and weight slices; the row replay
# (executor/rows.py, walked by executor/tiled.py) for a torch transformer's row tiles
# (model/torch_rows.py). An embedding reads the integer token ids `run --data` gives as x.
EXECUTOR = {
    "whole": {"copy", "conv2d", "conv1d", "conv3d", "maxpool", "avgpool", "global_avgpool", "batchnorm", "layernorm",
              "groupnorm", "instancenorm", "linear", "matmul", "softmax", "log_softmax", "attention", "embedding",
              "sub", "mul", "div"},
    "strips": {"concat", "conv2d", "maxpool", "avgpool", "global_avgpool", "batchnorm"},
    "rows": {"linear", "layernorm", "matmul", "softmax", "avgpool", "embedding"},
    "slices": {"conv2d", "linear", "concat", "embedding"},
}


def graph_runs(spec: OpSpec, tiling: str) -> bool:
    return tiling == "whole" or tiling in spec.tiled


def runs(spec: OpSpec, tiling: str, backend: str) -> bool:
    """Whether ``backend`` executes ``spec`` in ``tiling`` (else it refuses before solving)."""
    if not graph_runs(spec, tiling):
        return False
    if backend in ("graph", "validator", "header"):
        return True
    if spec.split == "elementwise" and spec.arity > 0:
        return _elementwise(spec, tiling, backend)
    return spec.name in (FIRMWARE if backend == "firmware" else EXECUTOR)[tiling]


def table() -> str:
    """docs/operators.md's tables, from the registry and the support sets above."""
    mark = {True: "yes", False: "-"}
    lines = ["| operator | family | PyTorch | ONNX | FLOPs | backward reads | split | C kernels |",
             "|---|---|---|---|---|---|---|---|"]
    for s in specs():
        torch_names = ", ".join([*(f"nn.{m}" for m in s.torch_modules), *s.torch_functions]) or "-"
        flops = f"{s.flops_per_element:g} / element" if s.flops_per_element is not None else (s.flop_rule or "0")
        kernels = ", ".join(k for k in (s.c_forward, s.c_backward) if k) or "-"
        lines.append(f"| `{s.name}` | {s.family} | {torch_names} | {', '.join(s.onnx) or '-'} | {flops} | "
                     f"{s.saves or 'nothing'} | {s.split} | {kernels} |")
    lines += ["", "What runs where (firmware / executor; graph, validator and C header run every tiling the "
              "graph builder splits the operator in):", "",
              "| operator | " + " | ".join(TILINGS_CHECKED) + " |", "|---|" + "---|" * len(TILINGS_CHECKED)]
    for s in specs():
        cells = []
        for t in TILINGS_CHECKED:
            if s.name in STRUCTURAL:
                cells.append("every graph")
            elif not graph_runs(s, t):
                cells.append("not split")
            else:
                cells.append(f"{mark[runs(s, t, 'firmware')]} / {mark[runs(s, t, 'executor')]}")
        lines.append(f"| `{s.name}` | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
