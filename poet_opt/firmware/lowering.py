"""Which network `emulate` trains for a PyTorch module and the command's options.

The firmware runs what `poet-opt solve` plans for the same options (model/load.py) and what `run`
executes (executor/train.py): resident or streamed weights (auto: streamed when resident ones do
not fit the device), weight slices over ``--weight-tile`` (default: a quarter of the budget),
activation strips along H for a CNN and row blocks of tokens for a transformer (auto: only when
some node would not fit the device whole; N, asked for, streams the weights). What differs is
only what the firmware itself cannot run, refused here before anything is solved, with the
option that would make it run. ``Lowering`` keeps one network per strip budget, as a re-solve
that fits the arena into a tighter budget asks for strips fit to that budget.
"""

from __future__ import annotations

from dataclasses import replace

from poet_opt.errors import PoetError
from poet_opt.model.load import default_tile_bytes, needs_streaming, strips_value, weights_for_strips
from poet_opt.model.network import Network, lower_network, rows_only
from poet_opt.model.torch_rows import tokens_in_rows
from poet_opt.units import parse_size

STACK_BYTES = 4096  # the kernels keep a few words each; the emulator measures the real depth


class Lowering:
    """``lowering(budget)``: the network whose graph a solve at that strip budget plans (cached per
    budget); ``network_of(graph)`` the one a plan's graph came from. ``table``: measured costs
    (MeasuredCosts) put on every graph."""

    def __init__(self, module, shape, profile, ram_bytes: int, *, name=None, trainable="all", weights="resident",
                 tile_bytes=None, strips="auto", table=None):
        strips = strips_value(strips)
        weights = weights_for_strips(strips, weights)
        self.module, self.shape, self.profile, self.name, self.trainable = module, shape, profile, name, trainable
        self.weights, self.strips, self.table, self.tile_bytes = weights, strips, table, tile_bytes
        self.lowered: dict[int, Network] = {}
        if weights not in ("resident", "streamed", "auto"):
            raise PoetError(f"unknown weights placement {weights!r}; choose resident, streamed or auto", field="--weights")
        if tile_bytes is not None:
            tile = parse_size(tile_bytes, field="--weight-tile")
            if tile < 1:
                raise PoetError("must be at least 1 B", field="--weight-tile")
            if weights == "resident":
                raise PoetError("weight tiles need streamed weights (--weights streamed or auto)", field="--weight-tile")
        else:  # as `poet-opt solve` slices streamed layers (model/load.py): one default for every command
            tile = None if weights == "resident" else default_tile_bytes([ram_bytes])
        try:
            whole = lower_network(module, shape, trainable=trainable, name=name,
                                  weights="resident" if weights == "auto" else weights,
                                  tile_bytes=tile if weights == "streamed" else None)
        except PoetError as exc:  # a written-out attention has views the firmware runs in row tiles only
            from poet_opt.model.torch_import import import_torch

            try:
                planned = import_torch(module, shape, trainable=trainable, weights="streamed", tile_bytes=tile)
            except PoetError:
                planned = None
            if planned is not None and strips == "off" and _wants_rows(planned, profile, "auto"):
                raise PoetError(f"this transformer fits {profile.name} only with its tokens in row tiles, which "
                                "--strips off turns off; give --strips auto or N", field="--strips") from None
            tiled = planned is not None and _wants_rows(planned, profile, strips)
            if planned is not None and strips == "auto" and not tiled and _wants_rows(planned, profile, 1):
                # it fits whole: in row tiles when no backend runs it whole in the placement solve gives its
                # weights (model/network.py, rows_only), as solve and run tile it; else only if asked
                resident = import_torch(module, shape, trainable=trainable)
                whole_resident = weights != "streamed" and rows_only(module, shape, resident,
                                                                      trainable=trainable) is None
                if whole_resident and (weights == "resident" or not needs_streaming(
                        resident, profile.memory.ram_bytes, STACK_BYTES, ram_bytes)):  # the executor runs it whole
                    raise PoetError(f"{exc.message}; in row tiles it does: give --strips N for N row blocks of "
                                    "tokens" + (" with --weights auto" if weights == "resident" else ""),
                                    field="--strips") from None
                if weights == "resident":
                    raise PoetError(f"{exc.message}; in row tiles it runs: give --weights auto or streamed",
                                    field="--weights") from None
                tiled = True  # streamed: this lowering refused it, and the executor streams it only in rows
            if not tiled:
                raise
            whole = None
        if whole is not None and weights == "auto" and \
                needs_streaming(whole.graph, profile.memory.ram_bytes, STACK_BYTES, ram_bytes):
            whole = lower_network(module, shape, trainable=trainable, name=name, weights="streamed", tile_bytes=tile)
        self.whole, self.tile = whole, tile

    def __call__(self, budget: int) -> Network:
        if budget not in self.lowered:
            from poet_opt.model.measured_costs import apply_costs

            # a default slice is a share of the budget the graph is fit to, as solve's is of --ram
            tile = default_tile_bytes([budget]) if self.tile_bytes is None and self.tile is not None else self.tile
            options = dict(trainable=self.trainable, name=self.name, weights=self.weights)
            net = _with_strips(self.whole, self.strips, self.module, self.shape, self.profile, budget, tile=tile,
                               **options) if self.whole is not None else \
                _with_rows(self.module, self.shape, self.profile, budget, self.strips, **options)
            # the file names this graph's nodes: a file for another model or lowering fails here
            self.lowered[budget] = net if self.table is None else replace(net, graph=apply_costs(net.graph, self.table))
        return self.lowered[budget]

    def network_of(self, graph) -> Network:
        return next(net for net in self.lowered.values() if net.graph is graph)


def _wants_rows(graph, profile, strips) -> bool:
    """Whether `solve` would plan this transformer in row tiles (model/load.py): --strips N, or some
    node too large for the device whole."""
    nodes = graph.nodes
    too_big = graph.largest_working_set()[0] + STACK_BYTES > profile.memory.ram_bytes
    return strips != "off" and (too_big or strips != "auto") and tokens_in_rows(nodes)


def _with_rows(module, shape, profile, ram, strips, *, trainable, name, weights) -> Network:
    """The transformer with its tokens in row tiles (model/torch_rows.py), every node within ``ram``
    ("auto": the tiling with the fewest nodes; N: N row blocks), refused before any solve when the
    firmware has no row kernel for one of its operators (firmware/row_codegen.py)."""
    from poet_opt.firmware.row_codegen import check_rows

    if weights == "resident":
        raise PoetError("row tiles cut a transformer's weights into tiles streamed from storage: they need "
                        "streamed weights (--weights auto or streamed)", field="--weights")
    budget = min(parse_size(ram, field="--ram"), profile.memory.ram_bytes - STACK_BYTES)
    network = lower_network(module, shape, trainable=trainable, name=name, weights="streamed", strips=strips,
                            strip_budget=budget)
    if network.graph is None:
        raise PoetError(f"no row tiling of the transformer brings every node within {budget:,} B", field="--ram")
    check_rows(network)
    return network


def _with_strips(network: Network, strips, module, shape, profile, ram, *, trainable, name, weights, tile) -> Network:
    """The network lowered with activation strips when ``strips`` asks for them, or ("auto") when
    some node cannot fit the device's RAM whole; the network as it is otherwise."""
    from poet_opt.units import format_bytes

    working, node = network.graph.largest_working_set()
    if _wants_rows(network.graph, profile, strips):
        return _with_rows(module, shape, profile, ram, strips, trainable=trainable, name=name, weights=weights)
    too_big = working + STACK_BYTES > profile.memory.ram_bytes and any(n.op == "conv2d" for n in network.graph.nodes)
    if strips not in ("auto", "off") and (isinstance(strips, bool) or not isinstance(strips, int) or strips < 1):
        raise PoetError(f"expected auto, off or a positive whole number, got {strips!r}", field="--strips")
    if strips == "off" or strips == "auto" and not too_big:
        if too_big:
            raise PoetError(f"computing {node.name} holds {format_bytes(working)} at once, more than "
                            f"{profile.name}'s {format_bytes(profile.memory.ram_bytes)} of RAM with the stack: it "
                            "needs its activations split into strips (strips='auto')", field="--ram")
        return network
    if weights == "resident":
        raise PoetError(f"computing {node.name} whole holds {format_bytes(working)}: activation strips need "
                        "streamed weights (--weights auto or streamed)", field="--weights")
    budget = min(parse_size(ram, field="--ram"), profile.memory.ram_bytes - STACK_BYTES)
    return lower_network(module, shape, trainable=trainable, name=name, weights="streamed", strips=strips,
                         strip_budget=budget, tile_bytes=tile)
