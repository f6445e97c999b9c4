"""One set of defaults (issue 27, item 4): `solve`, `run` and `emulate` lower a PyTorch module to
the same graph for the same options, or refuse it before solving; a plan one of them makes for a
module is a plan of the graph the others would run. Each command's own lowering is called, as the
command calls it, over weights auto, resident and streamed and strips auto, off and N."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from poet_opt import cli  # noqa: E402
from poet_opt.device.profiles import load_profile  # noqa: E402
from poet_opt.errors import PoetError  # noqa: E402
from poet_opt.executor.train import lower_for_run  # noqa: E402
from poet_opt.firmware.lowering import Lowering  # noqa: E402
from poet_opt.model.torch_import import resolve_module  # noqa: E402
from poet_opt.units import parse_size  # noqa: E402

HERE = Path(__file__).resolve().parent
CASES = {  # a CNN in strips, a transformer on token ids in row blocks, a table with a linear head
    "cnn": ("poet_opt.examples.torch_models:strip_cnn", "1,1,96,96", "nrf52840", "160KiB"),
    "tokens": ("poet_opt.examples.torch_models:small_token_classifier", "1,16", "nrf52840", "64KiB"),
    "bert": (f"{HERE / 'test_run_embedding.py'}:small_bert", "1,16", "stm32f746", "300KiB"),
    "words": (f"{HERE / 'test_run_embedding.py'}:bag_of_words", "2,16", "nrf52840", "64KiB"),
}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def outcome(lower):
    """The graph's nodes (name, bytes), or the refusal's field and line."""
    try:
        graph = lower()
    except PoetError as exc:
        return ("refused", exc.field, exc.message)
    return tuple((n.name, n.bytes) for n in graph.nodes)


def lowerings(case: str, weights: str, strips: str) -> dict:
    spec, shape, device, ram = CASES[case]
    profile = load_profile(device)
    memory = profile.memory

    def emulate():
        module, name = resolve_module(spec)
        lowering = Lowering(module, tuple(int(v) for v in shape.split(",")), profile, parse_size(ram), name=name,
                            weights=weights, strips=strips)
        return lowering(parse_size(ram)).graph

    return {
        "solve": outcome(lambda: cli.load_graph(None, None, batch_size=1, bytes_per_element=4, input_shape=shape,
                                                torch=spec, weights=weights, profile=profile, ram=[ram],
                                                strips=strips)[0]),
        "run": outcome(lambda: lower_for_run(spec, shape, weights=weights, strips=strips,
                                             device_ram_bytes=memory.ram_bytes,
                                             stack_reserve_bytes=memory.stack_reserve_bytes,
                                             ram_bytes=parse_size(ram)).graph),
        "emulate": outcome(emulate),
    }


@pytest.mark.parametrize("case, weights, strips", list(itertools.product(CASES, ("auto", "resident", "streamed"),
                                                                         ("auto", "off", "2"))))
def test_every_command_lowers_a_module_to_one_graph_or_refuses_it(case, weights, strips):
    got = lowerings(case, weights, strips)
    graphs = {command: nodes for command, nodes in got.items() if nodes[0] != "refused"}
    assert len(set(graphs.values())) <= 1, {c: len(n) for c, n in graphs.items()}
    # what solve plans, a backend runs; what no backend runs, solve refuses up front
    assert ("solve" in graphs) == (len(graphs) > 1), {c: o[:2] if o[0] == "refused" else len(o) for c, o in got.items()}
    if strips == "2":  # asked for: every command streams them, or all refuse with one line
        refusals = {c: o for c, o in got.items() if o[0] == "refused"}
        if weights == "resident":
            assert len(refusals) == 3 and len(set(refusals.values())) == 1, refusals
            assert refusals["solve"][1] == "--strips"
        else:
            assert not refusals, refusals
            assert any(name.startswith("param:") for name, _ in graphs["solve"])  # streamed weights


def test_a_transformer_no_backend_runs_whole_goes_to_row_tiles_in_every_command():
    """bert's twin reads its position table through an arange view, which neither backend runs
    whole: under the defaults every command tiles its tokens (it fits whole, so auto would tile
    nothing otherwise); asked for whole, every command refuses, naming the option that tiles it."""
    got = lowerings("bert", "auto", "auto")
    assert got["solve"][0] != "refused" and len(set(got.values())) == 1
    assert any("@r" in name for name, _ in got["solve"])
    for weights, strips, field in (("resident", "auto", "--weights"), ("streamed", "off", "--strips")):
        refused = lowerings("bert", weights, strips)
        assert {o[0] for o in refused.values()} == {"refused"}, refused
        assert refused["solve"][1] == field and "in row tiles it runs" in refused["solve"][2]


class _Scores(torch.nn.Module):
    """Two projections multiplied, then a softmax over the last axis written as the function."""

    def __init__(self, softmax):
        super().__init__()
        self.q, self.k, self.head, self.softmax = (torch.nn.Linear(6, 6), torch.nn.Linear(6, 6),
                                                   torch.nn.Linear(36, 3), softmax)

    def forward(self, x):
        return self.head(torch.flatten(self.softmax(torch.matmul(self.q(x), self.k(x))), 1))


@pytest.mark.parametrize("views", [False, True])  # the firmware's lowering and the executor's
def test_the_softmax_function_lowers_as_the_module(views):
    from poet_opt.model.network import lower_network

    def ops(softmax):
        return [layer.op for layer in lower_network(_Scores(softmax), (1, 6, 6), views=views).layers.values()]

    assert ops(lambda x: torch.softmax(x, -1)) == ops(torch.nn.Softmax(-1))
    with pytest.raises(PoetError, match="a softmax over a dimension other than the last"):
        ops(lambda x: torch.softmax(x, 1))


class _Dropped(torch.nn.Module):
    """The token transformer with dropout on its input: its trace drops dropout as a view."""

    def __init__(self):
        super().__init__()
        from poet_opt.examples.torch_models import EncoderClassifier

        self.drop, self.block = torch.nn.Dropout(0.1), EncoderClassifier(d=16, h=2, ff=32, classes=3)

    def forward(self, x):
        return self.block(self.drop(x))


def dropped():
    torch.manual_seed(0)
    return _Dropped()


def dropped_cnn():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Dropout(0.2),
                               torch.nn.Linear(4 * 6 * 6, 3))


def test_solve_refuses_a_cnn_with_dropout_as_both_backends_do():
    profile = load_profile("nrf52840")
    got = {
        "solve": outcome(lambda: cli.load_graph(None, None, batch_size=1, bytes_per_element=4, input_shape="1,1,8,8",
                                                torch=f"{__file__}:dropped_cnn", profile=profile, ram=["64KiB"])[0]),
        "run": outcome(lambda: lower_for_run(dropped_cnn(), "1,1,8,8", device_ram_bytes=profile.memory.ram_bytes,
                                             stack_reserve_bytes=profile.memory.stack_reserve_bytes,
                                             ram_bytes=64 * 1024).graph),
        "emulate": outcome(lambda: Lowering(dropped_cnn(), (1, 1, 8, 8), profile, 64 * 1024)(64 * 1024).graph),
    }
    for command, (kind, field, message) in got.items():
        assert kind == "refused" and field == "--torch" and "dropout" in message, (command, message)


def test_dropout_is_refused_by_every_command_in_every_tiling():
    """No backend reproduces dropout's random mask (a recompute would draw another); the row
    lowering used to drop it silently, so a default that tiles rows trained without it."""
    import numpy as np

    profile = load_profile("nrf52840")
    for weights, strips in (("auto", "auto"), ("streamed", "2"), ("resident", "off")):
        got = {
            "solve": outcome(lambda: cli.load_graph(None, None, batch_size=1, bytes_per_element=4,
                                                    input_shape="1,8,16", torch=f"{__file__}:dropped",
                                                    weights=weights,
                                                    profile=profile, ram=["64KiB"], strips=strips)[0]),
            "run": outcome(lambda: lower_for_run(dropped(), "1,8,16", weights=weights, strips=strips,
                                                 device_ram_bytes=profile.memory.ram_bytes,
                                                 stack_reserve_bytes=profile.memory.stack_reserve_bytes,
                                                 ram_bytes=64 * 1024, x=np.zeros((1, 8, 16), np.float32)).graph),
            "emulate": outcome(lambda: Lowering(dropped(), (1, 8, 16), profile, 64 * 1024, weights=weights,
                                                strips=strips)(64 * 1024).graph),
        }
        for command, (kind, field, message) in got.items():
            assert kind == "refused" and "dropout" in message, (weights, strips, command, message)
