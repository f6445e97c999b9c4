"""Row tiling (model/rows.py): the row-tiled transformer graph's maths equals the untiled model's,
node by node, in PyTorch; bert-base's tiled graph fits the nRF52840."""

from __future__ import annotations

import math

import pytest

from poet_opt.model.zoo import _encoder_block, _Net, training_graph

torch = pytest.importorskip("torch")
F = torch.nn.functional


def _tiny_bert(seq=8, d=16, heads=2, d_ff=32, vocab=11, layers=2) -> _Net:
    """bert-base's structure (model/zoo.py) at toy sizes: word and position tables, post-LN blocks,
    the pooler on [CLS] and a 3-class head."""
    net = _Net((seq,))
    x = net.add(net.embedding(0, "embeddings.word", vocab, d),
                net.embedding(0, "embeddings.position_type", seq + 2, d), "embeddings.add")
    x = net.layernorm(x, "embeddings.ln")
    for i in range(layers):
        x = _encoder_block(net, x, f"layer{i}", d, heads, d_ff)
    x = net.act(net.linear(x, "pooler.dense", d, cls_token=True), "pooler.tanh", "tanh")
    net.linear(x, "classifier", 3)
    return net


def _params(ops, gen):
    params = {}
    for o in ops:
        if o.op == "linear":
            fan_in = o.params // o.shape[-1] - 1
            params[o.name] = {"weight": torch.randn(o.shape[-1], fan_in, generator=gen, dtype=torch.float64) * 0.4,
                              "bias": 0.3 * torch.randn(o.shape[-1], generator=gen, dtype=torch.float64)}
        elif o.op == "layernorm":
            params[o.name] = {"weight": 1 + 0.3 * torch.randn(o.shape[-1], generator=gen, dtype=torch.float64),
                              "bias": 0.3 * torch.randn(o.shape[-1], generator=gen, dtype=torch.float64)}
        elif o.op == "embedding":
            params[o.name] = {"weight": torch.randn(o.params // o.shape[-1], o.shape[-1], generator=gen,
                                                    dtype=torch.float64)}
    return params


def _reference(ops, params, ids):
    """The untiled model in autograd, as examples/torch_models.py writes a block; every tensor kept."""
    out = []
    n, seq = ids.shape
    for o in ops:
        ins = [out[i] for i in o.inputs]
        p = params.get(o.name, {})
        if o.op == "input":
            out.append(ids)
            continue
        if o.op == "embedding":
            idx = torch.arange(seq).expand(n, -1) if "position" in o.name else ids
            v = p["weight"][idx]
        elif o.op == "add":
            v = ins[0] + ins[1]
        elif o.op == "layernorm":
            v = F.layer_norm(ins[0], (o.shape[-1],), p["weight"], p["bias"], eps=1e-5)
        elif o.op == "linear":
            x = ins[0][:, 0] if len(o.shape) == 1 and ins[0].dim() == 3 else ins[0]
            v = F.linear(x, p["weight"], p["bias"])
        elif o.op == "matmul" and len(o.shape) == 3:
            heads = o.shape[0]
            q, k = (t.view(n, seq, heads, -1).transpose(1, 2) for t in ins)
            v = q @ k.transpose(2, 3) / math.sqrt(q.shape[-1])
        elif o.op == "softmax":
            v = torch.softmax(ins[0], dim=-1)
        elif o.op == "matmul":
            heads = ins[0].shape[1]
            vv = ins[1].view(n, seq, heads, -1).transpose(1, 2)
            v = (ins[0] @ vv).transpose(1, 2).reshape(n, seq, -1)
        elif o.op == "gelu":
            v = F.gelu(ins[0])
        elif o.op == "tanh":
            v = torch.tanh(ins[0])
        v.retain_grad()
        out.append(v)
    return out


def _assemble(values, graph, layer, prefix=""):
    """The whole tensor (or gradient) from its pieces; None where a block is missing (pruned, or a
    gradient that is zero), as a mask of which rows were there."""
    meta = graph.meta["rows"]
    lay = meta.layers[layer]
    heads = lay.op == "softmax" or lay.op == "matmul" and len(lay.shape) == 3
    blocks = [(0, 1)] if len(lay.shape) == 1 else meta.blocks
    rows, present = [], []
    for b in range(len(blocks)):
        mark = "@h" if heads else "@c"
        names = [f"{prefix}{layer}@r{b}{mark}{j}" for j in range(len(meta.cols[layer]))]
        if all(nm in values for nm in names):
            parts = [values[nm] for nm in names]
            rows.append(torch.stack(parts, dim=1) if heads else torch.cat(parts, dim=2))
            present.append(True)
        else:
            rows.append(None)
            present.append(False)
    return rows, present, blocks, heads


def _close(a, b, what):
    # relative to the tensor's size, and to 1 where it is zero in exact arithmetic (the gradient of
    # K's bias: softmax ignores what it adds to every score of a row) and only rounding is left
    scale = max(float(b.abs().max()), 1.0 if float(b.abs().max()) < 1e-12 else 1e-30)
    err = float((a - b).abs().max()) / scale
    assert err <= 1e-9, f"{what}: relative error {err:.3g}"


@pytest.mark.parametrize("tiling", [{"blocks": 2, "piece": 8, "vocab_rows": 4},
                                    {"blocks": 8, "piece": 5, "vocab_rows": 3},
                                    {"blocks": 3, "piece": 16, "vocab_rows": 11},
                                    {"blocks": 1, "piece": 32, "vocab_rows": 2}])
def test_row_graph_replays_autograd_and_sgd_exactly(tiling):
    """Every node of the row-tiled graph run in PyTorch on its pieces, reading only its deps, gives
    the untiled model's loss, every tensor and gradient, every weight gradient and one SGD step
    equal to autograd and torch.optim.SGD (float64), down to one-token rows and pieces that cut
    across heads."""
    from poet_opt.executor.rows import replay

    net = _tiny_bert()
    graph = training_graph("tiny", net.ops, 2, 8, "all", {}, weights="streamed", rows=tiling)
    gen = torch.Generator().manual_seed(1)
    params = _params(net.ops, gen)
    ids = torch.randint(0, 11, (2, 8), generator=gen)
    y = torch.tensor([2, 0])
    lr = 0.1
    mine = {name: {r: v.clone() for r, v in layer.items()} for name, layer in params.items()}
    reference = [p.requires_grad_(True) for layer in params.values() for p in layer.values()]
    tensors = _reference(net.ops, params, ids)
    loss = F.cross_entropy(tensors[-1], y)
    loss.backward()
    result = replay(graph, mine, ids, y, lr)

    _close(result["loss"], loss.detach(), "loss")
    values = result["values"]
    for o, t in zip(net.ops[1:], tensors[1:]):
        for prefix, want in (("", t.detach()), ("grad:", t.grad)):
            rows, present, blocks, heads = _assemble(values, graph, o.name, prefix)
            for (r0, r1), got, there in zip(blocks, rows, present):
                part = want[:, :, r0:r1] if heads else (want[:, None] if want.dim() == 2 else want[:, r0:r1])
                if there:
                    _close(got, part, f"{prefix}{o.name} rows {r0}:{r1}")
                elif prefix:  # a gradient left out is zero
                    assert float(part.abs().max()) == 0.0, f"{prefix}{o.name} rows {r0}:{r1} left out"
                else:  # a forward block left out feeds nothing: its gradient is zero
                    assert float(t.grad[:, :, r0:r1].abs().max() if heads else t.grad[:, r0:r1].abs().max()) == 0
    for name, layer in params.items():
        for role, p in layer.items():
            _close(result["weight_grads"][name][role], p.grad, f"weight gradient of {name}.{role}")
    torch.optim.SGD(reference, lr=lr).step()
    for name, layer in params.items():
        for role, p in layer.items():
            _close(mine[name][role], p.detach(), f"{name}.{role} after SGD")


@pytest.mark.parametrize("trainable", ["last:2", "layer1"])
def test_frozen_layers_stay_and_trained_ones_step_as_sgd(trainable):
    """--trainable with row tiling: the trained layers' tiles take autograd's SGD step, the frozen
    ones are read (the gradient passes through them) and never written."""
    from poet_opt.executor.rows import replay

    net = _tiny_bert()
    graph = training_graph("tiny", net.ops, 1, 8, trainable, {}, weights="streamed",
                           rows={"blocks": 2, "piece": 8, "vocab_rows": 4})
    gen = torch.Generator().manual_seed(2)
    params = _params(net.ops, gen)
    mine = {name: {r: v.clone() for r, v in layer.items()} for name, layer in params.items()}
    ids, y = torch.randint(0, 11, (1, 8), generator=gen), torch.tensor([1])
    replay(graph, mine, ids, y, 0.1)
    for p in (p for layer in params.values() for p in layer.values()):
        p.requires_grad_(True)
    F.cross_entropy(_reference(net.ops, params, ids)[-1], y).backward()
    trained = {graph.meta["rows"].nodes[graph.nodes[p].name].layer for n in graph.nodes for p in n.updates}
    assert trained and trained != set(params)
    for name, layer in params.items():
        for role, p in layer.items():
            want = p.detach() - 0.1 * p.grad if name in trained else p.detach()
            _close(mine[name][role], want, f"{name}.{role}")

@pytest.fixture(scope="module")
def bert_nrf52840():
    """The graph `poet-opt solve --model bert-base --device nrf52840 --ram 200KiB` plans (streamed
    weights, rows fitted to 200 KiB, as model/load.py asks for them; about 4 s)."""
    from poet_opt.device.profiles import load_profile
    from poet_opt.model.zoo import build_model

    return build_model("bert-base", weights="streamed", rows={"budget": 200 * 1024}), load_profile("nrf52840")


def test_bert_base_rows_fit_the_nrf52840(bert_nrf52840):
    """Every node of bert-base's row-tiled graph holds at most 200 KiB (whole, the gelu's gradient
    alone holds 4.56 MiB), no node holds a whole (seq, d) tensor, and the pooler reads [CLS] only."""
    graph, _ = bert_nrf52840
    rows = graph.meta["rows"]
    assert graph.streams_weights and graph.largest_working_set()[0] <= 200 * 1024
    assert 20_000 < len(graph) < 100_000  # the solver's linear start handles 100,000 nodes in about 30 s
    assert max(n.bytes for n in graph.nodes) <= 128 * 768 * 4 // 3
    pooler = [n for n in graph.nodes if n.name.startswith("pooler.dense@r0")]
    assert pooler and all(graph.nodes[d].name.startswith(("layer11.ffn.ln@r0@", "param:", "pooler.dense@r0"))
                          for n in pooler for d in n.deps)
    assert not any(n.name.startswith("layer11.ffn.ln@r1") for n in graph.nodes) or len(rows.blocks) == 1
    updated = {p for n in graph.nodes for p in n.updates}  # every tile read is updated and written back once
    assert updated == {n.id for n in graph.nodes if n.op == "param"}
    assert sum(n.writes_bytes for n in graph.nodes) == sum(graph.nodes[p].bytes for p in updated)
    assert {rows.nodes[graph.nodes[p].name].layer for p in updated} == \
        {name for name, layer in rows.layers.items() if layer.params}


def test_bert_base_plans_on_the_stock_nrf52840_and_its_8gb_card(bert_nrf52840):
    """The plan that fits 200 KiB pages thousands of small tensors. In a 4 MiB allocation unit each
    they would need several times the 8 GB card; packed in sectors, as the card's controller places
    them, they take a few hundred MiB. The whole step fits the board, the plan validates, and the
    report gives the traffic and the card's lifetime under the worst-case wear of every write."""
    from poet_opt.schedule.decisions import stored_param_bytes
    from poet_opt.schedule.validator import validate
    from poet_opt.solver.driver import solve

    graph, profile = bert_nrf52840
    schedule = solve(graph, profile, ram="200KiB", time_limit=20)
    doc = schedule.to_dict()
    totals = validate(doc)
    memory = doc["memory"]
    assert memory["fits_device"] and memory["total_bytes"] + memory["stack_reserve_bytes"] <= profile.memory.ram_bytes
    assert memory["fits_storage"] and memory["stored_bytes"] <= profile.storage.capacity_bytes
    free = profile.storage.capacity_bytes - stored_param_bytes(graph, profile.storage)
    block = profile.storage.erase_block_bytes
    in_own_units = sum(-(-graph.nodes[i].bytes // block) * block for i in schedule.decisions.page_out)
    assert len(schedule.decisions.page_out) > 1000 and in_own_units > 2 * free
    assert totals["storage_read_bytes"] > graph.streamed_param_bytes  # every weight read at least once
    assert totals["storage_written_bytes"] >= sum(n.writes_bytes for n in graph.nodes)
    lifetime = schedule.lifetime_steps()
    assert lifetime == profile.storage.endurance_cycles * profile.storage.capacity_bytes // schedule.erased_bytes_per_step()
    assert 0 < lifetime < 100_000


def test_executors_refuse_a_row_plan_in_one_line():
    """The firmware generator and the PyTorch executor run a row plan only on a torch transformer
    lowered in its row tiles (tests/test_firmware_rows.py, tests/test_run_rows.py), not on this zoo
    model's nor on a network lowered whole: they say so in one line naming a row node, rather than
    mis-run the plan."""
    from types import SimpleNamespace

    from poet_opt.errors import PoetError
    from poet_opt.executor.runner import check_schedule
    from poet_opt.firmware import codegen
    from poet_opt.solver.driver import solve

    net = _tiny_bert()
    graph = training_graph("tiny", net.ops, 1, 4, "all", {}, weights="streamed",
                           rows={"blocks": 2, "piece": 8, "vocab_rows": 4})
    doc = solve(graph, "nrf52840", ram="64KiB", time_limit=5).to_dict()
    for call, who in ((lambda: check_schedule(None, doc), "PyTorch executor"),
                      (lambda: codegen.generate(SimpleNamespace(graph=SimpleNamespace(meta={})), doc, None, None,
                                               steps=1, lr=0.1, x=None, y=None),
                       "firmware generator")):
        with pytest.raises(PoetError, match=rf"tiles a transformer by token rows \(node \S+@r\d.*{who}") as info:
            call()
        assert "\n" not in str(info.value)


def test_a_solved_row_plan_trains_as_pytorch_sgd():
    """The PyTorch execution of a solved plan of the small BERT in rows (its re-reads, page-outs,
    page-ins and frees, each compute on resident tensors only) takes two SGD steps with the loss and
    weights of autograd and torch.optim.SGD on the untiled model, within the plan's RAM."""
    from poet_opt.executor.rows import run_plan
    from poet_opt.solver.driver import solve

    net = _tiny_bert()
    graph = training_graph("tiny", net.ops, 1, 4, "all", {}, weights="streamed",
                           rows={"blocks": 4, "piece": 8, "vocab_rows": 4})
    ram = graph.largest_working_set()[0] * 3 // 2
    doc = solve(graph, "nrf52840", ram=f"{ram}B", time_limit=5).to_dict()
    names = [n["name"] for n in doc["graph"]["nodes"]]
    steps = [(s["op"], names[s["node"]]) for s in doc["steps"]]
    assert any(op == "page_in" for op, _ in steps) and sum(op == "compute" for op, _ in steps) > len(names)
    gen = torch.Generator().manual_seed(4)
    params = _params(net.ops, gen)
    mine = {name: {r: v.clone() for r, v in layer.items()} for name, layer in params.items()}
    ids, y = torch.randint(0, 11, (1, 8), generator=gen), torch.tensor([2])
    sgd = torch.optim.SGD([p.requires_grad_(True) for layer in params.values() for p in layer.values()], lr=0.05)
    for _ in range(2):
        sgd.zero_grad()
        loss = F.cross_entropy(_reference(net.ops, params, ids)[-1], y)
        loss.backward()
        sgd.step()
        ran = run_plan(graph, steps, mine, ids, y, 0.05)
        _close(ran["loss"], loss.detach(), "loss")
        assert ran["peak_bytes"] <= ram
    for name, layer in params.items():
        for role, p in layer.items():
            _close(mine[name][role], p.detach(), f"{name}.{role} after two steps")


def test_too_many_row_blocks_are_refused_in_one_line():
    """One-token rows of a 128-token block sum K's and V's gradients over 128 x 128 pairs of blocks:
    `--strips 200` is refused before any graph is built, naming the field."""
    from poet_opt.errors import PoetError
    from poet_opt.model.zoo import build_model

    with pytest.raises(PoetError, match="128 row blocks make more than 200,000 nodes") as info:
        build_model("transformer-block", weights="streamed", rows={"budget": 200 * 1024, "blocks": 200})
    assert info.value.field == "--strips" and "\n" not in str(info.value)


def test_weights_beyond_the_storage_are_refused_before_the_rows_are_built(monkeypatch):
    """bert-base on the STM32F746: its weights cannot fit the 16 MiB flash whatever the tiling, so
    the refusal comes from the untiled streamed graph, not after seconds of building 57,843 nodes."""
    from poet_opt.cli import load_graph
    from poet_opt.device.profiles import load_profile
    from poet_opt.errors import PoetError
    from poet_opt.model import load

    def no_tiling(*args, **kwargs):
        raise AssertionError("the rows were built before the storage check")

    monkeypatch.setattr(load, "_striped", no_tiling)
    with pytest.raises(PoetError) as info:
        load_graph("bert-base", None, batch_size=1, bytes_per_element=4, weights="auto",
                   profile=load_profile("stm32f746"), ram=["200KiB"])
    assert info.value.field == "--weights" and "more than stm32f746's 16 MiB qspi-flash" in str(info.value)
