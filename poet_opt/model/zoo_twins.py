"""PyTorch modules for the zoo's models, layer for layer as the zoo builds them (same operators,
shapes and names; a test lowers each to the zoo's graph node for node), with PyTorch's default
initialisation under ``torch.manual_seed(SEED)``: `poet-opt emulate --model NAME` and `run --model
NAME` train these, all but the lone transformer block (``UNTRAINED`` says why, and the commands refuse
it before reading anything); `emulate` refuses bert-base too (``NOT_IN_FIRMWARE``: not for want of a
kernel, its embeddings and pooler have them, but for the emulated instructions a step of it takes),
which `run` trains. The zoo keeps its own builders because `solve --model` works without PyTorch."""

from __future__ import annotations

from poet_opt.errors import PoetError

SEED = 0


def _mcu_vww():
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int):
            super().__init__()
            self.dw = nn.Conv2d(cin, cin, 3, stride, 1, groups=cin, bias=False)
            self.dw_bn = nn.BatchNorm2d(cin)
            self.dw_relu = nn.ReLU()
            self.pw = nn.Conv2d(cin, cout, 1, bias=False)
            self.pw_bn = nn.BatchNorm2d(cout)
            self.pw_relu = nn.ReLU()

        def forward(self, x):
            return self.pw_relu(self.pw_bn(self.pw(self.dw_relu(self.dw_bn(self.dw(x))))))

    class McuVww(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv0 = nn.Conv2d(1, 4, 3, 2, 1, bias=False)
            self.bn0 = nn.BatchNorm2d(4)
            self.relu0 = nn.ReLU()
            cin = 4
            for i, (cout, stride) in enumerate(((8, 2), (16, 2), (32, 2), (32, 1), (64, 2), (64, 1)), 1):
                setattr(self, f"ds{i}", Block(cin, cout, stride))
                cin = cout
            self.avgpool = nn.AdaptiveAvgPool2d(1)
            self.fc = nn.Linear(64, 2)

        def forward(self, x):
            x = self.relu0(self.bn0(self.conv0(x)))
            for i in range(1, 7):
                x = getattr(self, f"ds{i}")(x)
            return self.fc(torch.flatten(self.avgpool(x), 1))

    torch.manual_seed(SEED)
    return McuVww()


def _mlp():
    import torch
    from torch import nn

    class Mlp(nn.Module):
        def __init__(self):
            super().__init__()
            for i, width in ((1, 256), (2, 256), (3, 256)):
                setattr(self, f"fc{i}", nn.Linear(784 if i == 1 else 256, width))
                setattr(self, f"relu{i}", nn.ReLU())
            self.fc4 = nn.Linear(256, 10)

        def forward(self, x):
            for i in (1, 2, 3):
                x = getattr(self, f"relu{i}")(getattr(self, f"fc{i}")(x))
            return self.fc4(x)

    torch.manual_seed(SEED)
    return Mlp()


def _mlp_residual():
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.relu1, self.fc2 = nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256)
            self.relu2 = nn.ReLU()

        def forward(self, x):
            return self.relu2(x + self.fc2(self.relu1(self.fc1(x))))

    class MlpResidual(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc_in, self.relu_in = nn.Linear(784, 256), nn.ReLU()
            self.block = Block()
            self.fc_out = nn.Linear(256, 10)

        def forward(self, x):
            return self.fc_out(self.block(self.relu_in(self.fc_in(x))))

    torch.manual_seed(SEED)
    return MlpResidual()


def _vgg16(imagenet: bool):
    """vgg16-cifar or vgg16-imagenet."""

    def make():
        import torch
        from torch import nn

        from poet_opt.model.zoo import VGG16_CHANNELS

        class Vgg16(nn.Module):
            """torchvision's vgg16_bn layer plan with the zoo's names: a 10-class head on the 1x1 map a
            32x32 input leaves, or ImageNet's three linear layers on the 7x7 map a 224x224 input
            leaves (torchvision's pool to 7x7 is then the identity, and the zoo leaves it out; a
            traced module cannot choose by shape, so this twin takes 224x224 only)."""

            def __init__(self):
                super().__init__()
                self.plan, cin, stage, i = [], 3, 1, 1
                for v in VGG16_CHANNELS:
                    if v == "M":
                        setattr(self, f"pool{stage}", nn.MaxPool2d(2, 2))
                        self.plan.append(f"pool{stage}")
                        stage, i = stage + 1, 1
                        continue
                    setattr(self, f"conv{stage}_{i}", nn.Conv2d(cin, v, 3, padding=1))
                    setattr(self, f"bn{stage}_{i}", nn.BatchNorm2d(v))
                    setattr(self, f"relu{stage}_{i}", nn.ReLU())
                    self.plan += [f"conv{stage}_{i}", f"bn{stage}_{i}", f"relu{stage}_{i}"]
                    cin, i = v, i + 1
                if not imagenet:
                    self.fc = nn.Linear(cin, 10)
                    return
                self.fc6, self.relu6 = nn.Linear(cin * 49, 4096), nn.ReLU()
                self.fc7, self.relu7 = nn.Linear(4096, 4096), nn.ReLU()
                self.fc8 = nn.Linear(4096, 1000)

            def forward(self, x):
                for name in self.plan:
                    x = getattr(self, name)(x)
                if not imagenet:
                    return self.fc(torch.flatten(x, 1))
                x = self.relu6(self.fc6(torch.flatten(x, 1)))
                return self.fc8(self.relu7(self.fc7(x)))

        torch.manual_seed(SEED)
        return Vgg16()

    return make


def _resnet(depths: tuple[int, ...], bottleneck: bool):
    """An ImageNet ResNet of the zoo (resnet18-imagenet, resnet50)."""

    def make():
        import torch

        from poet_opt.examples import torch_models

        torch.manual_seed(SEED)
        block = torch_models.Bottleneck if bottleneck else torch_models.BasicBlock
        return torch_models.ResNet(block, depths, cifar=False)

    return make


def _example(factory: str):
    """A zoo model whose PyTorch twin is in poet_opt.examples.torch_models (the module `--torch` is
    pointed at in the docs), seeded as the others."""

    def make():
        import torch

        from poet_opt.examples import torch_models

        torch.manual_seed(SEED)
        return getattr(torch_models, factory)()

    return make


def _encoder(d: int, heads: int, d_ff: int):
    """The zoo's post-LN encoder block (model/zoo.py) as PyTorch writes it: attention unfused, Q, K
    and V split into heads by view and transpose, scores divided by sqrt(d_head), heads joined by a
    transposing reshape. The zoo folds the division into the scores and the join into the context,
    as model/torch_rows.py maps a traced --torch transformer; :func:`lower_twin` does the same."""
    import torch
    from torch import nn

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v, self.out = (nn.Linear(d, d) for _ in range(4))
            self.ln = nn.LayerNorm(d)

        def forward(self, x):
            b, s, _ = x.shape
            q, k, v = (m(x).view(b, s, heads, d // heads).transpose(1, 2) for m in (self.q, self.k, self.v))
            probs = torch.softmax(q @ k.transpose(-2, -1) / (d // heads) ** 0.5, dim=-1)
            return self.ln(x + self.out((probs @ v).transpose(1, 2).reshape(b, s, d)))

    class FeedForward(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.gelu, self.fc2 = nn.Linear(d, d_ff), nn.GELU(), nn.Linear(d_ff, d)
            self.ln = nn.LayerNorm(d)

        def forward(self, x):
            return self.ln(x + self.fc2(self.gelu(self.fc1(x))))

    class EncoderBlock(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn, self.ffn = Attention(), FeedForward()

        def forward(self, x):
            return self.ffn(self.attn(x))

    return EncoderBlock()


def _transformer_block():
    import torch
    from torch import nn

    class TransformerBlock(nn.Module):
        """One encoder block on hidden states (batch, tokens, 768), no head: its output is the
        block's, as the zoo's graph puts its loss there."""

        def __init__(self):
            super().__init__()
            self.block = _encoder(768, 12, 3072)

        def forward(self, x):
            return self.block(x)

    torch.manual_seed(SEED)
    return TransformerBlock()


def bert(d: int = 768, heads: int = 12, d_ff: int = 3072, layers: int = 12, vocab: int = 30522,
         positions: int = 512, classes: int = 2):
    """BERT as the zoo builds it (no attention mask, no dropout, a ``classes``-way head), at any
    size; the defaults are bert-base's twin. Unseeded: :func:`zoo_module` seeds bert-base's."""
    import torch
    from torch import nn

    class Embeddings(nn.Module):
        """The zoo's one gather for positions and token types: a table of positions + 2 rows indexed
        by position (the last two rows are never read). The positions are a view of the token ids'
        shape, so that the trace sees this gather read the input, as the zoo's graph has it."""

        def __init__(self):
            super().__init__()
            self.word, self.position_type = nn.Embedding(vocab, d), nn.Embedding(positions + 2, d)
            self.ln = nn.LayerNorm(d)

        def forward(self, ids):
            where = torch.arange(ids.shape[1]).expand_as(ids)
            return self.ln(self.word(ids) + self.position_type(where))

    class Pooler(nn.Module):
        def __init__(self):
            super().__init__()
            self.dense, self.tanh = nn.Linear(d, d), nn.Tanh()

        def forward(self, x):
            return self.tanh(self.dense(x[:, 0]))  # the [CLS] token's

    class BertBase(nn.Module):
        def __init__(self):
            super().__init__()
            self.embeddings = Embeddings()
            for i in range(layers):
                setattr(self, f"layer{i}", _encoder(d, heads, d_ff))
            self.pooler, self.classifier = Pooler(), nn.Linear(d, classes)

        def forward(self, ids):
            x = self.embeddings(ids)
            for i in range(layers):
                x = getattr(self, f"layer{i}")(x)
            return self.classifier(self.pooler(x))

    return BertBase()


def _bert_base():
    import torch

    torch.manual_seed(SEED)
    return bert()


FACTORIES = {"mcu-vww": _mcu_vww, "mlp": _mlp, "mlp-residual": _mlp_residual, "vgg16-cifar": _vgg16(imagenet=False),
             "vgg16-imagenet": _vgg16(imagenet=True),
             "resnet18-cifar": _example("resnet18"), "mobilenetv2": _example("mobilenetv2"),
             "resnet18-imagenet": _resnet((2, 2, 2, 2), bottleneck=False),
             "resnet50": _resnet((3, 4, 6, 3), bottleneck=True),
             "transformer-block": _transformer_block, "bert-base": _bert_base}

_TRANSFORMERS = ("transformer-block", "bert-base")
_INSTEAD = "--torch poet_opt.examples.torch_models:encoder_classifier trains an encoder block with a classifier head"
# Twins that `emulate` and `run` cannot train, and why: refused before anything is read or solved
UNTRAINED = {
    "transformer-block": "ends in the block's hidden states (tokens x 768), with no classifier head: the firmware and "
                         "`run` train with cross-entropy on logits, which hidden states are not",
}
# Twins that `run` trains and `emulate` does not, and why. bert-base: its training graph's 6.7e10
# FLOPs at the 1.56 emulated instructions a FLOP the firmware took for the examples' encoder block
# in row tiles (docs/firmware.md: 453 M for 2.9e8), at benchmarks/FIRMWARE.md's 35 M a second. Built
# once (lower, solve, generate, cross-compile; not emulated): rows refit to the arena the statics
# leave, 109,632 nodes, 2,119 s to solve on a shared 2-core machine, a 5.7 MB step program on the SD
# card, 226,968 B of the nRF52840's 262,144 B of RAM
NOT_IN_FIRMWARE = {
    "bert-base": "would take about 1e11 emulated instructions a step (its 6.7e10 FLOPs in the firmware's row tiles), "
                 "close to an hour of emulation at about 35 M instructions a second, after a half-hour solve of its "
                 "109,632 row-tile nodes; the firmware has its kernels and builds it, and trains a reduced twin of it "
                 "in row tiles (docs/firmware.md, \"Token ids\")",
}
TRAINED = tuple(sorted(n for n in FACTORIES if n not in UNTRAINED))  # by `run`
FIRMWARE_TRAINED = tuple(n for n in TRAINED if n not in NOT_IN_FIRMWARE)  # by `emulate`


def _key(name) -> str:
    return str(name).strip().lower().replace("_", "-")  # as the zoo spells its names


def check_trains(name: str, *, firmware: bool = False) -> None:
    """Refuse, naming why and what to train instead, a zoo model `run` (or, ``firmware``, `emulate`)
    cannot train."""
    key = _key(name)
    if key in UNTRAINED:
        raise PoetError(f"zoo model {key!r} {UNTRAINED[key]}; `solve --model {key}` plans it, and {_INSTEAD}",
                        field="--model")
    if firmware and key in NOT_IN_FIRMWARE:
        raise PoetError(f"zoo model {key!r} {NOT_IN_FIRMWARE[key]}; `poet-opt run --model {key}` trains it in "
                        f"PyTorch, following the plan `solve --model {key}` makes", field="--model")
    if key not in FACTORIES:
        listed = FIRMWARE_TRAINED if firmware else TRAINED
        raise PoetError(f"no PyTorch twin of zoo model {name!r}; train one of {', '.join(listed)}, "
                        "or give --torch FILE.py:FACTORY", field="--model")


def twin_input_shape(name: str, batch: int, sample: tuple[int, ...]) -> tuple[int, ...]:
    """The twin's whole input for the zoo's per-sample input shape: a lone encoder block reads
    hidden states (tokens, 768), not the token ids the zoo's shape counts."""
    if _key(name) == "transformer-block":
        return (batch, *sample, 768)
    return (batch, *sample)


def lower_twin(name: str, module, input_shape):
    """The training graph of ``module`` (zoo model ``name``'s twin) as the zoo shapes it. A
    transformer's attention is traced as PyTorch writes it, with a division of the scores by a
    constant and a copy that joins the heads; the zoo's graph has neither node (the division is
    folded into the scores, the join is a view of the context), so they are folded here."""
    from dataclasses import replace

    from poet_opt.model.network import lower_network
    from poet_opt.model.operators import finish
    from poet_opt.model.torch_import import lower_module

    if _key(name) not in _TRANSFORMERS:
        return lower_network(module, input_shape).graph
    ops, output = lower_module(module, input_shape)
    src, kept, index = ops.ops, [], {}
    for i, o in enumerate(src):
        of_heads = o.inputs and src[o.inputs[0]].op == "matmul" and len(src[o.inputs[0]].shape) == 4
        if of_heads and o.op in ("div", "mul") and len(o.inputs) == 1 and not o.params:
            index[i] = index[o.inputs[0]]
        elif of_heads and o.op == "copy":
            index[i] = index[o.inputs[0]]
            kept[index[i]] = replace(kept[index[i]], shape=o.shape)
        else:
            index[i] = len(kept)
            kept.append(replace(o, inputs=tuple(index[x] for x in o.inputs)))
    meta = {"source": name, "format": "torch.fx", "input_shape": list(input_shape), "batch_size": input_shape[0]}
    return finish(name, kept, index[output], bytes_per_element=4, trainable="all", meta=meta, field="--model")


def zoo_module(name: str, *, training: bool = True):
    """The seeded PyTorch module of zoo model ``name``; ``training``: one `emulate` and `run` train
    (:func:`check_trains`), else any twin (to compare its lowering with the zoo's)."""
    key = _key(name)
    if training or key not in FACTORIES:
        check_trains(key)
    return FACTORIES[key]()
