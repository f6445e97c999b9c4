"""Proof by execution: a schedule that recomputes and pages, exported as a C header and walked by the
reference runtime (schedules/runtime/) with C kernels, computes exactly the weight gradients of
plain backprop.

For the zoo's `mlp` and `mlp-residual` (a skip connection), each at a RAM budget at which the
optimal schedule both recomputes and pages: solve, export, generate the per-node kernel dispatch
from the training graph (tests/c/kernels.c holds the maths), compile with the system gcc
(-std=c99 -Wall -Wextra -Werror -pedantic), run one training step with fixed weights and inputs,
and compare every weight and bias gradient with a NumPy float64 reference of plain backprop that
reads only the forward graph. The debug build of the runtime shadows the arena and reports any
byte touched outside a live tensor's interval; the run must report none, and deliberately faulty
kernels, tables and callbacks must be caught.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from poet_opt.firmware.arena import plan_flash
from poet_opt.firmware.header import export
from poet_opt.model.graph import TrainingGraph
from poet_opt.device.profiles import DeviceProfile
from poet_opt.solver.driver import solve
from poet_opt.model.zoo import build_model

GCC = shutil.which("gcc")
ARM_GCC = shutil.which("arm-none-eabi-gcc")
pytestmark = pytest.mark.skipif(GCC is None, reason="gcc not installed")

ROOT = Path(__file__).resolve().parent.parent
RUNTIME = ROOT / "schedules" / "runtime"
KERNELS = Path(__file__).resolve().parent / "c"
STRICT = ["-std=c99", "-Wall", "-Wextra", "-Werror", "-pedantic", "-Wunused-const-variable=2"]
# The arena is bytes the kernels read and write as floats, as in any firmware's tensor arena.
BUILD = [*STRICT, "-O1", "-fno-strict-aliasing"]

BATCH = 2
FEATURES = 64
RTOL = 1e-5

# Round compute figures (1 GFLOP/s at 1 W) and a fast flash whose power sets the price of paging
# against recomputing. The two networks need different prices for their optimal schedules to mix
# both (the mlp pays its input's reload and pages a hidden activation; the residual net recomputes
# its first layer and pages a gradient); both settle to optimality in well under a second.
STORAGE_POWER_W = {"mlp": 0.25, "mlp-residual": 1.0}


def exec_profile(storage_power_w: float, kind: str = "spi-flash") -> DeviceProfile:
    transfer = {"latency_s": 1e-6, "power_w": storage_power_w}
    return DeviceProfile.model_validate({
        "name": "exec-test", "description": "host run of the C execution test", "cpu": "host",
        "compute": {"flops_per_second": 1e9, "active_power_w": 1.0},
        "memory": {"ram_bytes": 1 << 20, "bytes_per_element": 4, "alignment_bytes": 16},
        "storage": {"kind": kind, "capacity_bytes": 1 << 24, "erase_block_bytes": 256 if kind == "spi-flash" else 4096,
                    "endurance_cycles": 100_000,
                    "read": {**transfer, "bytes_per_second": 4e7},
                    "write": {**transfer, "bytes_per_second": 2e7}},
    })


@dataclass
class Case:
    name: str
    graph: TrainingGraph
    doc: dict
    header: str
    dir: Path
    debug_exe: Path
    release_exe: Path
    params: dict[int, tuple[np.ndarray, np.ndarray]]
    x: np.ndarray
    target: np.ndarray


# ---------------------------------------------------------------- generated kernel dispatch


def features(graph: TrainingGraph, node: int) -> int:
    return graph.nodes[node].bytes // (4 * BATCH)


def param_layout(graph: TrainingGraph) -> dict[int, tuple[int, int]]:
    """Offset (in floats) of each linear node's W [out][in] and b [out] in params.bin."""
    layout, at = {}, 0
    for n in graph.nodes:
        if n.kind == "forward" and n.op == "linear":
            fan_in, out = features(graph, n.deps[0]), features(graph, n.id)
            layout[n.id] = (at, at + out * fan_in)
            at += out * fan_in + out
    return layout


def net_sources(graph: TrainingGraph) -> tuple[str, str]:
    """net.h and net.c: one case per node, calling tests/c/kernels.c. Every tensor a gradient needs
    is looked up among the node's deps, so a backward rule the zoo forgot fails here."""
    nodes = graph.nodes
    forward = [n for n in nodes if n.kind == "forward"]
    loss = next(n for n in nodes if n.kind == "loss")
    logits = loss.deps[0]
    by_name = {n.name: n for n in nodes}
    grad_of = {n.name[len("grad:"):]: n.id for n in nodes if n.kind == "backward"}
    users = {f.id: [u for u in forward if f.id in u.deps] for f in forward}
    layout = param_layout(graph)
    total = sum(features(graph, n.deps[0]) * features(graph, n.id) + features(graph, n.id) for n in nodes
                if n.id in layout)

    def w(node, table="net_params"):
        return f"{table} + {layout[node][0]}u"

    def b(node, table="net_params"):
        return f"{table} + {layout[node][1]}u"

    cases = []
    for n in nodes:
        size = n.bytes // 4
        pos = {d: k for k, d in enumerate(n.deps)}

        def arg(d):
            return f"CF(in[{pos[d]}])"  # KeyError: the node lacks a tensor its maths needs

        body = []
        if n.op == "input":
            body.append(f"k_copy(F(out), net_input, {size}u);")
        elif n.kind == "forward" and n.op == "linear":
            body.append(f"k_linear(F(out), {arg(n.deps[0])}, {w(n.id)}, {b(n.id)}, {BATCH}u, "
                        f"{features(graph, n.deps[0])}u, {features(graph, n.id)}u);")
        elif n.kind == "forward" and n.op == "relu":
            body.append(f"k_relu(F(out), {arg(n.deps[0])}, {size}u);")
        elif n.kind == "forward" and n.op == "add":
            body.append(f"k_add(F(out), {arg(n.deps[0])}, {arg(n.deps[1])}, {size}u);")
        elif n.kind == "loss":
            body.append(f"k_loss(F(out), {arg(logits)}, net_target, {BATCH}u, {features(graph, logits)}u);")
            body.append(f"k_copy(net_loss, CF(out), {BATCH}u);")
        elif n.kind == "backward":
            f = by_name[n.name[len("grad:"):]]
            body.append(f"k_zero(F(out), {size}u);")
            if f.id == logits:
                body.append(f"k_loss_grad_acc(F(out), {arg(logits)}, {arg(loss.id)}, net_target, {BATCH}u, "
                            f"{features(graph, logits)}u);")
            for u in users[f.id]:
                du = arg(grad_of[u.name])
                if u.op == "linear":
                    body.append(f"k_linear_data_grad_acc(F(out), {du}, {w(u.id)}, {BATCH}u, "
                                f"{features(graph, f.id)}u, {features(graph, u.id)}u);")
                elif u.op == "relu":
                    body.append(f"k_relu_grad_acc(F(out), {du}, {arg(u.id)}, {size}u);")
                elif u.op == "add":
                    body.append(f"k_add_grad_acc(F(out), {du}, {size}u);")
                else:
                    raise AssertionError(f"no backward kernel for {u.op}")
            if f.trainable:
                body.append(f"k_linear_weight_grad({w(f.id, 'net_grads')}, {b(f.id, 'net_grads')}, CF(out), "
                            f"{arg(f.deps[0])}, {BATCH}u, {features(graph, f.deps[0])}u, {features(graph, f.id)}u);")
        else:
            raise AssertionError(f"no kernel for {n.kind} {n.op}")
        cases.append(f"    case {n.id}u: /* {n.name} */\n"
                     f"        if (n_in != {len(n.deps)}u || bytes != {n.bytes}u) return 1000;\n"
                     + "".join(f"        {line}\n" for line in body) + "        break;")

    header = f"""#ifndef NET_H
#define NET_H
#include <stdint.h>
#include "poet_runtime.h"
#define NET_BATCH {BATCH}u
#define NET_INPUT_FLOATS {nodes[0].bytes // 4}u
#define NET_PARAM_FLOATS {total}u
#define NET_NUM_NODES {len(nodes)}u
enum {{ NET_FAULT_NONE, NET_FAULT_OVERFLOW, NET_FAULT_CLOBBER_INPUT, NET_FAULT_FAIL }};
/* after computing `node`, misbehave: write the byte `delta` past the output's end, flip a bit of
   input 0, or fail */
extern float net_params[NET_PARAM_FLOATS], net_grads[NET_PARAM_FLOATS], net_input[NET_INPUT_FLOATS];
extern int32_t net_target[NET_BATCH];
extern unsigned long net_computes[NET_NUM_NODES];
int net_kernel(void *user, uint32_t node, const uint8_t *const *in, uint32_t n_in, uint8_t *out, uint32_t bytes);
void net_fault(uint32_t node, int kind, uint32_t delta);
float net_loss_total(void);
#endif
"""
    source = f"""#include "net.h"
#include "kernels.h"
#define F(p) ((float *)(void *)(p))
#define CF(p) ((const float *)(const void *)(p))
float net_params[NET_PARAM_FLOATS], net_grads[NET_PARAM_FLOATS], net_input[NET_INPUT_FLOATS];
int32_t net_target[NET_BATCH];
unsigned long net_computes[NET_NUM_NODES];
static float net_loss[NET_BATCH];
static uint32_t fault_node = 0xFFFFFFFFu;
static int fault_kind;
static uint32_t fault_delta;

void net_fault(uint32_t node, int kind, uint32_t delta) {{ fault_node = node; fault_kind = kind; fault_delta = delta; }}

float net_loss_total(void) {{
    float sum = 0.0f;
    uint32_t r;
    for (r = 0; r < NET_BATCH; r++) sum += net_loss[r];
    return sum / (float)NET_BATCH;
}}

int net_kernel(void *user, uint32_t node, const uint8_t *const *in, uint32_t n_in, uint8_t *out, uint32_t bytes) {{
    (void)user;
    switch (node) {{
{chr(10).join(cases)}
    default:
        return 1001;
    }}
    net_computes[node]++;
    if (node == fault_node) {{
        if (fault_kind == NET_FAULT_OVERFLOW) out[bytes + fault_delta] = 0x5A;
        if (fault_kind == NET_FAULT_CLOBBER_INPUT) ((uint8_t *)(uintptr_t)in[0])[0] ^= 0x01u; /* inputs are read-only */
        if (fault_kind == NET_FAULT_FAIL) return 42;
    }}
    return 0;
}}
"""
    return header, source


# ---------------------------------------------------------------- NumPy reference


def reference_gradients(graph: TrainingGraph, params, x: np.ndarray, target: np.ndarray):
    """Plain backprop in float64 over the forward graph only (independent of the zoo's backward
    nodes): mean softmax cross-entropy over the batch."""
    forward = [n for n in graph.nodes if n.kind == "forward"]
    value = {}
    for n in forward:
        if n.op == "input":
            value[n.id] = x.astype(np.float64)
        elif n.op == "linear":
            W, b = params[n.id]
            value[n.id] = value[n.deps[0]] @ W.astype(np.float64).T + b
        elif n.op == "relu":
            value[n.id] = np.maximum(value[n.deps[0]], 0.0)
        elif n.op == "add":
            value[n.id] = value[n.deps[0]] + value[n.deps[1]]
        else:
            raise AssertionError(n.op)
    z = value[forward[-1].id]
    lse = np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1)
    loss = float(np.mean(lse - z[np.arange(BATCH), target]))
    grad = {n.id: np.zeros_like(value[n.id]) for n in forward}
    grad[forward[-1].id] = (np.exp(z - lse[:, None]) - np.eye(z.shape[1])[target]) / BATCH
    out = {}
    for n in reversed(forward):
        g = grad[n.id]
        if n.op == "linear":
            W, _ = params[n.id]
            out[n.id] = (g.T @ value[n.deps[0]], g.sum(0))
            grad[n.deps[0]] += g @ W.astype(np.float64)
        elif n.op == "relu":
            grad[n.deps[0]] += g * (value[n.id] > 0)
        elif n.op == "add":
            for d in n.deps:
                grad[d] += g
    return out, loss


# ---------------------------------------------------------------- build and run


def compile_harness(workdir: Path, exe: Path, *defines: str) -> None:
    sources = [KERNELS / "harness.c", KERNELS / "kernels.c", workdir / "net.c", RUNTIME / "poet_runtime.c"]
    cmd = [GCC, *BUILD, *defines, "-I", str(workdir), "-I", str(RUNTIME), "-I", str(KERNELS),
           *map(str, sources), "-lm", "-o", str(exe)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stderr == "", done.stderr


def run(case: Case, mode: str = "ok", *args: int, release: bool = False) -> dict:
    exe = case.release_exe if release else case.debug_exe
    args = [str(exe), str(case.dir), mode, *map(str, args)]
    done = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, (done.returncode, done.stdout, done.stderr)
    out = done.stdout
    status = {k: int(v) for k, v in re.findall(r"(\w+)=(-?\d+)", re.search(r"^rc=.*$", out, re.M).group(0))}
    violations = [{k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", line)}
                  for line in out.splitlines() if line.startswith("violation ")]
    flash = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", re.search(r"^flash .*$", out, re.M).group(0))}
    computes = [int(v) for v in re.search(r"^computes (.*)$", out, re.M).group(1).split()]
    loss = float(re.search(r"^loss=(\S+)$", out, re.M).group(1))
    grads = np.fromfile(case.dir / "grads.bin", dtype=np.float32)
    return {"status": status, "violations": violations, "flash": flash, "computes": computes, "loss": loss,
            "grads": grads}


def solved_case(name: str, tmp_path_factory, kind: str = "spi-flash", storage_power_w: float | None = None) -> Case:
    graph = build_model(name, input_shape=(FEATURES,), batch_size=BATCH)
    lo, hi = graph.min_working_set_bytes(), graph.plain_peak_bytes()
    # A twentieth of the way from the least RAM any schedule needs to plain training's peak: tight
    # enough that the optimum must give something up, with room for the arena's alignment padding.
    ram = lo + (hi - lo) // 20
    power = STORAGE_POWER_W[name] if storage_power_w is None else storage_power_w
    doc = solve(graph, exec_profile(power, kind), ram=ram, time_limit=20, gap=1e-9, threads=1,
                model_name=name).to_dict()
    header, plan, _ = export(doc)
    assert plan.arena_bytes <= ram
    workdir = tmp_path_factory.mktemp(f"{name}-{kind}")
    (workdir / "plan.h").write_text(header)
    net_h, net_c = net_sources(graph)
    (workdir / "net.h").write_text(net_h)
    (workdir / "net.c").write_text(net_c)

    rng = np.random.default_rng(7)
    params = {}
    for node in param_layout(graph):  # He-initialised weights, small biases
        fan_in, out = features(graph, graph.nodes[node].deps[0]), features(graph, node)
        params[node] = (rng.normal(0, np.sqrt(2 / fan_in), (out, fan_in)).astype(np.float32),
                        rng.normal(0, 0.1, out).astype(np.float32))
    flat = np.concatenate([a.ravel() for pair in params.values() for a in pair])  # param_layout's order
    flat.tofile(workdir / "params.bin")
    x = rng.normal(0, 1, (BATCH, FEATURES)).astype(np.float32)
    target = rng.integers(0, features(graph, next(n for n in graph.nodes if n.kind == "loss").deps[0]),
                          BATCH).astype(np.int32)
    x.tofile(workdir / "input.bin")
    target.tofile(workdir / "target.bin")

    debug_exe, release_exe = workdir / "harness_debug", workdir / "harness_release"
    compile_harness(workdir, debug_exe, "-DPOET_RUNTIME_DEBUG")
    compile_harness(workdir, release_exe)
    return Case(name, graph, doc, header, workdir, debug_exe, release_exe, params, x, target)


@pytest.fixture(scope="module", params=["mlp", "mlp-residual"])
def case(request, tmp_path_factory) -> Case:
    return solved_case(request.param, tmp_path_factory)


def flatten(grads: dict, graph: TrainingGraph) -> list[tuple[str, np.ndarray]]:
    """In the order of params.bin and grads.bin: by node id, W then b."""
    return [(f"{graph.nodes[n].name}.{part}", g) for n in sorted(grads) for part, g in zip("Wb", grads[n])]


def relative_errors(case: Case, got: np.ndarray) -> dict[str, float]:
    ref, _ = reference_gradients(case.graph, case.params, case.x, case.target)
    errors, at = {}, 0
    for name, g in flatten(ref, case.graph):
        mine = got[at:at + g.size].reshape(g.shape).astype(np.float64)
        at += g.size
        errors[name] = float(np.max(np.abs(mine - g)) / np.max(np.abs(g)))
    assert at == got.size
    return errors


# ---------------------------------------------------------------- the proof


def test_schedule_recomputes_and_pages(case):
    totals = case.doc["totals"]
    assert totals["recomputes"] >= 1 and totals["page_ins"] >= 1, totals
    if case.name == "mlp-residual":
        assert any(len(n.deps) == 2 and n.op == "add" for n in case.graph.nodes)


def test_one_training_step_in_c_matches_numpy_backprop(case):
    result = run(case)
    assert result["status"]["rc"] == 0, result["status"]
    assert result["violations"] == [] and result["status"]["violations"] == 0
    # the schedule really ran: every compute (recomputations included) and every paging step
    steps = case.doc["steps"]
    want = [sum(1 for s in steps if s["op"] == "compute" and s["node"] == n) for n in range(len(case.graph))]
    assert result["computes"] == want and max(want) > 1
    assert result["flash"]["page_ins"] == case.doc["totals"]["page_ins"] > 0
    assert result["flash"]["page_outs"] == case.doc["totals"]["page_outs"]
    assert result["flash"]["bytes_written"] == sum(case.graph.nodes[s["node"]].bytes for s in steps
                                                   if s["op"] == "page_out")
    errors = relative_errors(case, result["grads"])
    assert len(errors) == 2 * sum(1 for n in case.graph.nodes if n.kind == "forward" and n.op == "linear")
    worst = max(errors, key=errors.get)
    assert errors[worst] < RTOL, (worst, errors[worst])
    _, loss = reference_gradients(case.graph, case.params, case.x, case.target)
    assert abs(result["loss"] - loss) <= RTOL * abs(loss)


def test_a_card_packed_in_sectors_pages_with_the_same_result(tmp_path_factory):
    """On a wear-levelled SD card paged tensors share allocation units, sector after sector: the
    runtime writes and reads them at those offsets, and the step computes what numpy does."""
    packed = solved_case("mlp-residual", tmp_path_factory, kind="sd-card", storage_power_w=0.25)  # pages two
    assert "#define POET_REGION_ALIGNMENT_BYTES 512u" in packed.header
    offsets = sorted(plan_flash(packed.doc).offsets.values())
    assert len(offsets) >= 2 and any(o % 4096 for o in offsets), offsets
    result = run(packed)
    assert result["status"]["rc"] == 0 and result["violations"] == [], result["status"]
    assert result["flash"]["page_outs"] == packed.doc["totals"]["page_outs"] > 0
    errors = relative_errors(packed, result["grads"])
    assert max(errors.values()) < RTOL, errors


def test_release_build_computes_the_same_bits(case):
    debug, release = run(case), run(case, release=True)
    assert release["status"]["rc"] == 0 and release["violations"] == []
    assert np.array_equal(release["grads"], debug["grads"])


# ---------------------------------------------------------------- the guard fires


def compute_step(case: Case, node: int) -> int:
    return next(s for s, step in enumerate(case.doc["steps"]) if step["op"] == "compute" and step["node"] == node)


def first_computes(case: Case):
    """(step, node, arena offset, bytes) of each node's first compute, where the faults strike."""
    plan, seen = export(case.doc)[1], set()
    for s, step in enumerate(case.doc["steps"]):
        if step["op"] == "compute" and step["node"] not in seen:
            seen.add(step["node"])
            yield s, step["node"], plan.step_offsets[s], case.graph.nodes[step["node"]].bytes


def test_a_kernel_writing_past_its_output_is_reported(case):
    plan = export(case.doc)[1]
    s, node, offset, size = next(c for c in first_computes(case) if 0 < c[2] + c[3] < plan.arena_bytes)
    result = run(case, "overflow", node, 0)
    assert (result["status"]["rc"], result["status"]["step"]) == (6, s)
    assert [(v["what"], v["step"], v["node"], v["offset"], v["bytes"]) for v in result["violations"]] == \
        [(5, s, node, offset + size, 1)]


def test_a_write_past_the_arena_hits_the_guard(case):
    plan = export(case.doc)[1]
    s, node, offset, size = next(first_computes(case))
    result = run(case, "overflow", node, plan.arena_bytes - (offset + size))
    assert (result["status"]["rc"], result["status"]["step"]) == (6, s)
    assert [(v["what"], v["offset"], v["bytes"], v["victim"]) for v in result["violations"]] == \
        [(6, plan.arena_bytes, 1, 0xFFFFFFFF)]


def test_a_kernel_writing_into_its_input_is_reported(case):
    loss = next(n for n in case.graph.nodes if n.kind == "loss")
    result = run(case, "clobber-input", loss.id)
    plan = export(case.doc)[1]
    s = compute_step(case, loss.id)
    assert result["status"]["rc"] == 6
    assert [(v["what"], v["step"], v["offset"], v["victim"]) for v in result["violations"]] == \
        [(5, s, plan.operand_offsets[s][0], loss.deps[0])]


def test_an_operand_pointing_at_the_wrong_tensor_is_reported(case):
    plan = export(case.doc)[1]
    nodes = case.graph.nodes
    # a compute's second operand moved onto its first one's tensor (where the second still fits)
    s, dep = next((s, nodes[step["node"]].deps[1]) for s, step in enumerate(case.doc["steps"])
                  if len(plan.operand_offsets[s]) >= 2
                  and plan.operand_offsets[s][0] + nodes[nodes[step["node"]].deps[1]].bytes <= plan.arena_bytes)
    k = sum(len(o) for o in plan.operand_offsets[:s]) + 1
    result = run(case, "bad-operand", k)
    assert (result["status"]["rc"], result["status"]["step"]) == (6, s)
    assert [(v["what"], v["offset"], v["victim"]) for v in result["violations"]] == \
        [(1, plan.operand_offsets[s][0], dep)]


def test_callback_failures_stop_the_step_with_their_code(case):
    first_page_in = next(s for s, st in enumerate(case.doc["steps"]) if st["op"] == "page_in")
    failed = run(case, "fail-read")["status"]
    assert (failed["rc"], failed["step"], failed["code"]) == (2, first_page_in, -7)
    node = case.graph.nodes[-1].id
    failed = run(case, "fail-kernel", node)["status"]
    assert (failed["rc"], failed["step"], failed["node"], failed["code"]) == (1, compute_step(case, node), node, 42)
    # a release build refuses a debug struct instead of silently running unchecked
    assert run(case, "force-debug", release=True)["status"]["rc"] == 7


# ---------------------------------------------------------------- portability


@pytest.mark.skipif(ARM_GCC is None, reason="arm-none-eabi-gcc not installed")
@pytest.mark.parametrize("defines", [[], ["-DPOET_RUNTIME_DEBUG"]])
def test_runtime_builds_for_cortex_m4(tmp_path, case, defines):
    (tmp_path / "plan.h").write_text(case.header)
    (tmp_path / "use.c").write_text('#include "plan.h"\n#include "poet_runtime.h"\nPOET_RT_DEFINE_PLAN(plan, POET_);\n'
                                    "const poet_rt_plan_t *the_plan(void) { return &plan; }\n")
    for source in (RUNTIME / "poet_runtime.c", tmp_path / "use.c"):
        done = subprocess.run([ARM_GCC, *STRICT, "-mcpu=cortex-m4", "-mthumb", "-Os", *defines, "-I", str(RUNTIME),
                               "-I", str(tmp_path), "-c", str(source), "-o", str(tmp_path / "x.o")],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and done.stderr == "", done.stderr


def test_two_plans_with_their_own_prefixes_share_one_runtime(tmp_path):
    from poet_opt.firmware.arena import plan_arena, plan_flash
    from poet_opt.firmware.header import render_header

    docs = {}
    for prefix, name in (("MLP_", "mlp"), ("RES_", "mlp-residual")):
        graph = build_model(name, input_shape=(FEATURES,), batch_size=BATCH)
        docs[prefix] = solve(graph, exec_profile(1.0), ram=graph.plain_peak_bytes(), time_limit=20).to_dict()
        (tmp_path / f"{name}.h").write_text(render_header(docs[prefix], plan_arena(docs[prefix]),
                                                          plan_flash(docs[prefix]), prefix=prefix))
    (tmp_path / "two.c").write_text(
        '#include "mlp.h"\n#include "mlp-residual.h"\n#include "poet_runtime.h"\n'
        "POET_RT_DEFINE_PLAN(mlp_plan, MLP_);\nPOET_RT_DEFINE_PLAN(res_plan, RES_);\n"
        "unsigned total_steps(void) { return mlp_plan.num_steps + res_plan.num_steps; }\n")
    done = subprocess.run([GCC, *STRICT, "-I", str(tmp_path), "-I", str(RUNTIME), "-c", str(tmp_path / "two.c"),
                           "-o", str(tmp_path / "two.o")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stderr == "", done.stderr


# ---------------------------------------------------------------- the checked-in examples

EXAMPLES = ROOT / "schedules" / "examples"

# Every kernel fills its output with its node id; the flash keeps nothing. The debug build still
# proves, on real plans of hundreds of nodes, that the runtime reads each example's tables the way
# the exporter wrote them: every operand live where its table says, no output over a live tensor.
SMOKE = r"""
#include <stdio.h>
#include "plan.h"
#include "poet_runtime.h"
POET_RT_DEFINE_PLAN(plan, POET_);

static uint8_t arena[POET_ARENA_BYTES + POET_RT_GUARD_BYTES + POET_ARENA_ALIGNMENT];
static uint8_t shadow[POET_ARENA_BYTES + POET_RT_GUARD_BYTES];
static uint32_t resident[POET_NUM_TENSORS];
static poet_rt_kernel_fn kernels[POET_NUM_TENSORS];
static unsigned long calls;

static int fill(void *user, uint32_t node, const uint8_t *const *in, uint32_t n_in, uint8_t *out, uint32_t bytes) {
    uint32_t b;
    (void)user; (void)in;
    if (n_in > POET_MAX_OPERANDS) return 1;
    for (b = 0; b < bytes; b++) out[b] = (uint8_t)node;
    calls++;
    return 0;
}
static int nowhere_read(void *user, uint32_t offset, uint8_t *dst, uint32_t bytes) {
    uint32_t b;
    (void)user; (void)offset;
    for (b = 0; b < bytes; b++) dst[b] = 0;
    calls++;
    return 0;
}
static int nowhere_write(void *user, uint32_t offset, const uint8_t *src, uint32_t bytes) {
    (void)user; (void)offset; (void)src; (void)bytes;
    calls++;
    return 0;
}
static void on_violation(void *user, const poet_rt_violation_t *v) {
    (void)user;
    printf("violation what=%u step=%u\n", (unsigned)v->what, (unsigned)v->step);
}

int main(void) {
    poet_rt_callbacks_t cb;
    poet_rt_debug_t dbg;
    poet_rt_error_t err;
    uint8_t *a = arena + (POET_ARENA_ALIGNMENT - (uintptr_t)arena % POET_ARENA_ALIGNMENT) % POET_ARENA_ALIGNMENT;
    uint32_t n;
    int rc;
    for (n = 0; n < POET_NUM_TENSORS; n++) kernels[n] = fill;
    cb.kernels = kernels;
    cb.read = nowhere_read;
    cb.write = nowhere_write;
    cb.user = 0;
    dbg.shadow = shadow;
    dbg.resident = resident;
    dbg.report = on_violation;
    rc = poet_rt_run(&plan, &cb, a, &dbg, &err);
    printf("rc=%d step=%u violations=%u calls=%lu\n", rc, (unsigned)err.step, (unsigned)dbg.violations, calls);
    return 0;
}
"""


@pytest.mark.parametrize("header", sorted(EXAMPLES.glob("*.h")), ids=lambda p: p.stem)
def test_runtime_walks_every_checked_in_example(tmp_path, header):
    (tmp_path / "plan.h").write_text(header.read_text())
    (tmp_path / "smoke.c").write_text(SMOKE)
    exe = tmp_path / "smoke"
    done = subprocess.run([GCC, *BUILD, "-DPOET_RUNTIME_DEBUG", "-I", str(tmp_path), "-I", str(RUNTIME),
                           str(tmp_path / "smoke.c"), str(RUNTIME / "poet_runtime.c"), "-o", str(exe)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    out = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60).stdout
    steps = re.search(r"#define POET_NUM_STEPS (\d+)u", header.read_text()).group(1)
    free = len(re.findall(r"\{POET_FREE,", header.read_text()))
    assert out.splitlines()[-1] == f"rc=0 step={steps} violations=0 calls={int(steps) - free}", out[-2000:]
