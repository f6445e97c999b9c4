import pytest

from poet_opt.errors import PoetError
from poet_opt.model.zoo import MODELS, build_model


def _count(graph, kind):
    return sum(n.kind == kind for n in graph.nodes)


def _forward_flops(graph):
    return sum(n.flops for n in graph.nodes if n.kind == "forward")


def _params(graph, prefix=""):
    return sum(n.param_bytes for n in graph.nodes if n.name.startswith(prefix)) // 4


def _by_name(graph):
    return {n.name: n for n in graph.nodes}


@pytest.fixture(scope="module")
def zoo():
    return {name: build_model(name) for name in MODELS}


def test_every_model_is_a_well_formed_training_graph(zoo):
    assert set(zoo) == {"mlp", "mlp-residual", "vgg16-cifar", "vgg16-imagenet", "resnet18-cifar", "resnet18-imagenet", "resnet50",
                        "mobilenetv2", "mcu-vww", "transformer-block", "bert-base"}
    for name, g in zoo.items():
        assert all(n.id == i for i, n in enumerate(g.nodes)), name
        assert all(d < n.id for n in g.nodes for d in n.deps), name
        assert _count(g, "loss") == 1, name
        assert g.nodes[0].op == "input" and g.nodes[0].kind == "forward" and g.nodes[0].flops == 0
        # trainable="all": every forward op but the input needs an output gradient
        assert _count(g, "backward") == _count(g, "forward") - 1, name
        loss = next(n for n in g.nodes if n.kind == "loss")
        assert loss.bytes == 4 and g.nodes[loss.deps[0]].kind == "forward"
        first_grad = g.nodes[loss.id + 1]
        assert first_grad.name == f"grad:{g.nodes[loss.deps[0]].name}" and loss.id in first_grad.deps
        # forward nodes come first, then the loss, then gradients: no forward op reads a gradient
        kinds = [n.kind for n in g.nodes]
        assert kinds == sorted(kinds, key=("forward", "loss", "backward").index), name
        assert len({n.name for n in g.nodes}) == len(g.nodes), name
        assert g.meta["model"] == name and g.meta["batch_size"] == 1
        assert g.meta["forward_layers"] == _count(g, "forward") - 1
        assert g.plain_peak_bytes() > 0 and g.param_grad_bytes == g.param_bytes


def test_resnet18_cifar_structure(zoo):
    g = zoo["resnet18-cifar"]
    # input; stem conv, bn, relu; 8 basic blocks of 7 ops; 3 downsample conv+bn pairs; avgpool; fc
    assert _count(g, "forward") == 1 + 3 + 8 * 7 + 3 * 2 + 2 == 68
    assert _count(g, "backward") == 67
    assert g.meta["input_shape"] == [3, 32, 32]


def test_resnet18_cifar_activation_bytes_match_a_hand_count(zoo):
    elements = (
        3 * 32 * 32  # input
        + 3 * 64 * 32 * 32  # conv1, bn1, relu (no max-pool)
        + 2 * 7 * 64 * 32 * 32  # layer1: 2 blocks x (conv, bn, relu, conv, bn, add, relu)
        + (2 * 7 + 2) * 128 * 16 * 16  # layer2, plus the downsample conv and bn
        + (2 * 7 + 2) * 256 * 8 * 8
        + (2 * 7 + 2) * 512 * 4 * 4
        + 512 + 10  # avgpool, fc
    )
    g = zoo["resnet18-cifar"]
    assert sum(n.bytes for n in g.nodes if n.kind == "forward") == 4 * elements == 8_140_840


@pytest.mark.parametrize("name, expected, prefix", [
    ("resnet18-imagenet", 11_689_512, ""),
    ("resnet50", 25_557_032, ""),
    ("vgg16-imagenet", 138_365_992, ""),  # torchvision vgg16_bn; plain vgg16 has 138,357,544
    ("mobilenetv2", 3_504_872, ""),
    ("bert-base", 85_054_464, "layer"),  # the 12 encoder blocks
    ("bert-base", 23_837_184, "embeddings"),  # 30522 words, 512 positions, 2 token types, LN
    ("transformer-block", 7_087_872, ""),
    ("mlp", 784 * 256 + 256 + 2 * (256 * 256 + 256) + 256 * 10 + 10, ""),
])
def test_parameter_counts_match_the_published_ones(zoo, name, expected, prefix):
    assert _params(zoo[name], prefix) == pytest.approx(expected, rel=0.02)


def test_resnet18_imagenet_forward_flops(zoo):
    assert _forward_flops(zoo["resnet18-imagenet"]) == pytest.approx(2 * 1.82e9, rel=0.10)


def test_other_forward_flops_are_the_known_macs_times_two(zoo):
    assert _forward_flops(zoo["resnet50"]) == pytest.approx(2 * 4.1e9, rel=0.10)
    assert _forward_flops(zoo["vgg16-imagenet"]) == pytest.approx(2 * 15.5e9, rel=0.10)
    assert _forward_flops(zoo["mobilenetv2"]) == pytest.approx(2 * 0.30e9, rel=0.15)


def test_mcu_model_fits_a_microcontroller(zoo):
    g = zoo["mcu-vww"]
    assert g.nodes[0].bytes == 96 * 96 * 4
    assert max(n.bytes for n in g.nodes) <= 64 * 1024
    assert g.plain_peak_bytes() < 300 * 1024
    assert g.param_bytes < 100 * 1024


def test_bytes_and_flops_scale_linearly_with_batch_size():
    one, four = build_model("resnet18-cifar"), build_model("resnet18-cifar", batch_size=4)
    assert [n.name for n in one.nodes] == [n.name for n in four.nodes]
    for a, b in zip(one.nodes, four.nodes):
        assert b.bytes == 4 * a.bytes and b.flops == pytest.approx(4 * a.flops)
        assert b.param_bytes == a.param_bytes and b.deps == a.deps
    assert four.plain_peak_bytes() == 4 * one.plain_peak_bytes()
    half = build_model("resnet18-cifar", bytes_per_element=2)
    assert half.plain_peak_bytes() * 2 == one.plain_peak_bytes() and half.param_bytes * 2 == one.param_bytes


def test_backward_dependencies_follow_what_each_operator_saves():
    g = build_model("transformer-block")
    node, names = _by_name(g), [n.name for n in g.nodes]

    def deps(name):
        return {names[d] for d in node[name].deps}

    # dL/dq flows back through scores = q @ k^T, which needs k; q's weight gradient reads the input
    assert deps("grad:block.attn.q") == {"grad:block.attn.scores", "block.attn.k", "input"}
    # back through softmax needs its output; back through gelu needs its input
    assert "block.attn.softmax" in deps("grad:block.attn.scores")
    assert deps("grad:block.ffn.fc1") == {"grad:block.ffn.gelu", "block.ffn.fc1", "block.attn.ln"}
    # the residual stream gathers gradients from both of its users
    assert {"grad:block.ffn.fc1", "grad:block.ffn.add"} <= deps("grad:block.attn.ln")
    # a gradient is as large as the tensor it is the gradient of
    assert node["grad:block.ffn.gelu"].bytes == node["block.ffn.gelu"].bytes


def test_mlp_backward_chain():
    g = build_model("mlp")
    node, names = _by_name(g), [n.name for n in g.nodes]
    assert [n.name for n in g.nodes if n.kind == "backward"] == [
        "grad:fc4", "grad:relu3", "grad:fc3", "grad:relu2", "grad:fc2", "grad:relu1", "grad:fc1"]
    assert {names[d] for d in node["grad:fc4"].deps} == {"loss", "fc4", "relu3"}
    # relu saves its output; fc2's weight gradient reads relu1 too
    assert {names[d] for d in node["grad:fc1"].deps} == {"grad:relu1", "relu1", "input"}
    assert {names[d] for d in node["grad:fc2"].deps} == {"grad:relu2", "relu2", "relu1"}
    # weight gradient (= forward FLOPs) plus the data gradient back through relu1
    assert node["grad:fc1"].flops == node["fc1"].flops + node["relu1"].flops


def test_last_n_trainable_trims_the_backward_graph():
    full = build_model("resnet18-cifar")
    last2 = build_model("resnet18-cifar", trainable="last:2")
    assert [n.name for n in last2.nodes if n.trainable] == ["layer4.1.bn2", "fc"]
    assert _count(last2, "backward") < _count(full, "backward")
    assert 0 < last2.param_grad_bytes < full.param_grad_bytes
    assert last2.param_bytes == full.param_bytes  # frozen weights still take memory
    only_fc = build_model("resnet18-cifar", trainable="fc")
    assert [n.name for n in only_fc.nodes if n.kind == "backward"] == ["grad:fc"]
    grad_fc = only_fc.nodes[-1]
    assert {only_fc.nodes[d].name for d in grad_fc.deps} == {"loss", "fc", "avgpool"}


def test_trainable_by_name_and_prefix():
    g = build_model("resnet18-cifar", trainable="layer4, fc")
    trained = [n.name for n in g.nodes if n.trainable]
    assert trained[-1] == "fc" and all(t.startswith("layer4.") for t in trained[:-1])
    assert len(trained) == 4 + 2 + 4 + 1  # two blocks of conv+bn pairs, the downsample pair, fc
    grads = {n.name for n in g.nodes if n.kind == "backward"}
    assert "grad:layer3.1.relu2" not in grads and "grad:layer4.0.conv1" in grads
    # a frozen layer between two trained ones still passes the gradient down
    mid = build_model("resnet18-cifar", trainable=["layer1.0.conv1", "fc"])
    assert "grad:layer3.0.conv1" in {n.name for n in mid.nodes}
    assert not _by_name(mid)["layer3.0.conv1"].trainable


@pytest.mark.parametrize("trainable, words", [
    ("fcc", ["'fcc'", "fc"]),
    (["layer4.1.conv3"], ["layer4.1.conv1", "layer4.1.conv2"]),
    ("relu", ["no parameters"]),
    ("last:0", ["last:N"]),
    ("none", ["nothing"]),
])
def test_bad_trainable_specs(trainable, words):
    with pytest.raises(PoetError) as err:
        build_model("resnet18-cifar", trainable=trainable)
    assert err.value.field == "--trainable"
    assert all(w in err.value.one_line() for w in words)


def test_unknown_model_names_suggest_close_ones():
    with pytest.raises(PoetError) as err:
        build_model("resnet18")
    assert err.value.field == "--model"
    assert "resnet18-cifar" in err.value.one_line() and "resnet18-imagenet" in err.value.one_line()
    with pytest.raises(PoetError, match="mobilenetv2"):
        build_model("mobilenet-v2")
    with pytest.raises(PoetError, match="known models: mlp"):
        build_model("alexnet")
    with pytest.raises(PoetError, match="resnet18-cifar or resnet18-imagenet"):
        build_model("ResNet-18")
    assert build_model("ResNet18_CIFAR").name == "resnet18-cifar"


def test_input_shape_overrides_and_checks():
    g = build_model("resnet18-cifar", input_shape=(3, 64, 64))
    assert g.nodes[0].bytes == 3 * 64 * 64 * 4 and g.meta["input_shape"] == [3, 64, 64]
    assert build_model("mobilenetv2", input_shape="3x160x160").meta["input_shape"] == [3, 160, 160]
    short = build_model("bert-base", input_shape=(64,))
    assert short.nodes[0].bytes == 64 * 4 and _params(short) == _params(build_model("bert-base"))
    assert build_model("transformer-block", input_shape=32).nodes[0].bytes == 32 * 768 * 4
    for name, shape in [("resnet18-cifar", (3, 32)), ("resnet18-cifar", (3, 32.5, 32)), ("vgg16-cifar", (3, 16, 16)),
                        ("bert-base", (1024,)), ("mlp", "0")]:
        with pytest.raises(PoetError) as err:
            build_model(name, input_shape=shape)
        assert err.value.field == "--input-shape", (name, shape)
    with pytest.raises(PoetError) as err:
        build_model("mlp", batch_size=0)
    assert err.value.field == "--batch-size"
