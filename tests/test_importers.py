import json
import random
from pathlib import Path

import pytest

from poet_opt.errors import PoetError
from poet_opt.model.node_link import load_node_link

SHARED_GRAPHS = Path(__file__).resolve().parents[2] / "shared" / "graphs"
SAMPLES = sorted(SHARED_GRAPHS.glob("*.json")) if SHARED_GRAPHS.is_dir() else []


@pytest.mark.skipif(not SAMPLES, reason="../shared/graphs is not present")
@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.stem)
def test_shared_samples_load(path):
    raw = json.loads(path.read_text())
    g = load_node_link(path)
    assert len(g) == len(raw["nodes"])
    assert sum(n.kind == "backward" for n in g.nodes) == sum(n["backward"] for n in raw["nodes"])
    assert sum(n.kind == "loss" for n in g.nodes) == 1
    assert all(d < n.id for n in g.nodes for d in n.deps)
    assert len(g.edges) == len({(l["source"], l["target"]) for l in raw["links"]})
    by_name = {n["name"]: n for n in raw["nodes"]}
    for node in g.nodes:
        assert node.bytes == by_name[node.name]["cost_ram"]
        assert node.compute_s == by_name[node.name]["cost_cpu"]
    assert g.name == raw["graph"]["name"]


def _write(tmp_path, doc, name="g.json"):
    path = tmp_path / name
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return path


def _node(i, name=None, backward=False, ram=64, cpu=0.01):
    return {"id": i, "name": name or f"n{i}", "backward": backward, "cost_cpu": cpu, "cost_ram": ram}


def _chain_doc():
    """x -> a -> loss -> ga, with x also read by ga (the weight gradient)."""
    nodes = [_node(10, "x", ram=100), _node(7, "a", ram=200), _node(3, "loss", ram=4), _node(42, "ga", True, ram=200)]
    links = [(10, 7), (7, 3), (3, 42), (7, 42), (10, 42)]
    return {"directed": True, "graph": {}, "nodes": nodes, "links": [{"source": s, "target": t} for s, t in links]}


def test_shuffled_ids_and_order_are_renumbered(tmp_path):
    doc = _chain_doc()
    random.Random(3).shuffle(doc["nodes"])
    random.Random(4).shuffle(doc["links"])
    g = load_node_link(_write(tmp_path, doc, "chain.json"))
    assert [n.name for n in g.nodes] == ["x", "a", "loss", "ga"]
    assert [n.kind for n in g.nodes] == ["forward", "forward", "loss", "backward"]
    assert [n.deps for n in g.nodes] == [(), (0,), (1,), (0, 1, 2)]
    assert [n.bytes for n in g.nodes] == [100, 200, 4, 200]
    assert g.name == "chain" and g.meta["source"].endswith("chain.json")


def test_string_ids_edges_alias_and_zero_costs(tmp_path):
    # (a node without cost_cpu is an error, docs/graphs.md: test_graph_ids.py)
    doc = {"nodes": [{"id": "b", "cost_ram": 0, "cost_cpu": 0}, {"id": "a", "cost_ram": 8, "cost_cpu": 0.5}],
           "edges": [{"source": "a", "target": "b"}]}
    g = load_node_link(_write(tmp_path, doc))
    assert [(n.name, n.deps, n.bytes, n.compute_s) for n in g.nodes] == [("a", (), 8, 0.5), ("b", (0,), 0, 0)]
    assert g.meta["given_ids"] == ["a", "b"]


def test_many_inputs_per_node(tmp_path):
    n = 300
    nodes = [_node(i, ram=16 * (i + 1)) for i in range(n)]
    links = [{"source": j, "target": i} for i in range(1, n) for j in {i - 1, i // 2, i // 3}]
    g = load_node_link(_write(tmp_path, {"nodes": nodes[::-1], "links": links}))
    assert len(g) == n and all(d < node.id for node in g.nodes for d in node.deps)
    assert max(len(node.deps) for node in g.nodes) == 3


def _error(tmp_path, doc):
    path = _write(tmp_path, doc)
    with pytest.raises(PoetError) as err:
        load_node_link(path)
    line = err.value.one_line()
    assert str(path) in line and err.value.source == str(path) and err.value.field
    assert err.value.field in line and "\n" not in line
    return err.value


def test_cycle(tmp_path):
    doc = _chain_doc()
    doc["links"].append({"source": 42, "target": 10})
    err = _error(tmp_path, doc)
    assert err.field == "links" and "cycle" in err.message


def test_dangling_edge(tmp_path):
    doc = _chain_doc()
    doc["links"].append({"source": 7, "target": 99})
    err = _error(tmp_path, doc)
    assert err.field == "links[5].target" and "99" in err.message


def test_duplicate_id(tmp_path):
    doc = _chain_doc()
    doc["nodes"].append(_node(7, "again"))
    err = _error(tmp_path, doc)
    assert err.field == "nodes[4].id" and "duplicate" in err.message


@pytest.mark.parametrize("drop, field", [("id", "nodes[1].id"), ("cost_ram", "nodes[1].cost_ram")])
def test_missing_node_field(tmp_path, drop, field):
    doc = _chain_doc()
    del doc["nodes"][1][drop]
    assert _error(tmp_path, doc).field == field


def test_missing_nodes_and_links(tmp_path):
    assert _error(tmp_path, {"links": []}).field == "nodes"
    assert _error(tmp_path, {"nodes": [_node(0)]}).field == "links"
    assert _error(tmp_path, [1, 2]).field == "(top level)"
    assert _error(tmp_path, {"nodes": [], "links": []}).field == "nodes"


def test_not_json(tmp_path):
    err = _error(tmp_path, '{"nodes": [\n  {"id": 0,,}\n]}')
    assert "not valid JSON" in err.message and err.field.startswith("line 2")


@pytest.mark.parametrize("key, value, field", [
    ("cost_ram", -1, "nodes[2].cost_ram"),
    ("cost_cpu", -0.5, "nodes[2].cost_cpu"),
    ("cost_ram", "64", "nodes[2].cost_ram"),
    ("cost_ram", float("nan"), "nodes[2].cost_ram"),
    ("backward", "yes", "nodes[2].backward"),
])
def test_bad_costs(tmp_path, key, value, field):
    doc = _chain_doc()
    doc["nodes"][2][key] = value
    assert _error(tmp_path, doc).field == field


def test_missing_file(tmp_path):
    with pytest.raises(PoetError) as err:
        load_node_link(tmp_path / "nope.json")
    assert "nope.json" in err.value.one_line()
