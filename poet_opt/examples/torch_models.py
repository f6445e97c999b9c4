"""Example networks in plain PyTorch (no torchvision), for ``poet-opt solve --torch``.

Layer names follow the model zoo (``poet_opt.model.zoo``), so an imported graph can be compared with the
zoo's node by node: ``poet-opt solve --torch poet_opt.examples.torch_models:resnet18 --input-shape
1,3,32,32 ...`` and ``--model resnet18-cifar`` describe the same network. Each factory takes no
argument and returns an ``nn.Module``; its input shape is given on the command line. Each seeds
torch's generator first (with the zoo's seed), so that the module `--torch` trains in a separate
process has the weights a reference built here has: an unseeded ResNet-18 trained by `emulate
--torch` and compared with the seeded twin differed by 0.38 of the largest weight, which read as a
firmware defect (benchmarks/FIRMWARE.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _conv_bn(cin: int, cout: int, k: int, stride: int = 1, groups: int = 1) -> tuple[nn.Conv2d, nn.BatchNorm2d]:
    return nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=False), nn.BatchNorm2d(cout)


class BasicBlock(nn.Module):
    def __init__(self, cin: int, width: int, stride: int):
        super().__init__()
        self.conv1, self.bn1 = _conv_bn(cin, width, 3, stride)
        self.relu1 = nn.ReLU()
        self.conv2, self.bn2 = _conv_bn(width, width, 3)
        self.relu2 = nn.ReLU()
        self.downsample = nn.Sequential(*_conv_bn(cin, width, 1, stride)) if stride != 1 or cin != width else None

    def forward(self, x):
        y = self.relu1(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        shortcut = x if self.downsample is None else self.downsample(x)
        return self.relu2(y + shortcut)


class Bottleneck(nn.Module):
    """torchvision's ResNet v1.5 bottleneck: the stride sits on the 3x3 convolution."""

    def __init__(self, cin: int, width: int, stride: int):
        super().__init__()
        self.conv1, self.bn1 = _conv_bn(cin, width, 1)
        self.relu1 = nn.ReLU()
        self.conv2, self.bn2 = _conv_bn(width, width, 3, stride)
        self.relu2 = nn.ReLU()
        self.conv3, self.bn3 = _conv_bn(width, 4 * width, 1)
        self.relu3 = nn.ReLU()
        cout = 4 * width
        self.downsample = nn.Sequential(*_conv_bn(cin, cout, 1, stride)) if stride != 1 or cin != cout else None

    def forward(self, x):
        y = self.relu1(self.bn1(self.conv1(x)))
        y = self.relu2(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        shortcut = x if self.downsample is None else self.downsample(x)
        return self.relu3(y + shortcut)


class ResNet(nn.Module):
    """The zoo's ResNets: the CIFAR variant (3x3 stem, no max-pool, 10 classes) or ImageNet's (7x7
    stride-2 stem and a max-pool, 1000 classes), of basic blocks or bottlenecks."""

    def __init__(self, block=BasicBlock, depths=(2, 2, 2, 2), cifar: bool = True, num_classes: int | None = None):
        super().__init__()
        self.conv1, self.bn1 = _conv_bn(3, 64, 3) if cifar else _conv_bn(3, 64, 7, 2)
        self.relu = nn.ReLU()
        self.maxpool = None if cifar else nn.MaxPool2d(3, 2, 1)
        expansion = 4 if block is Bottleneck else 1
        cin, stages = 64, []
        for stage, (width, n) in enumerate(zip((64, 128, 256, 512), depths)):
            stride = 1 if stage == 0 else 2
            blocks = [block(cin, width, stride)] + [block(width * expansion, width, 1) for _ in range(n - 1)]
            stages.append(nn.Sequential(*blocks))
            cin = width * expansion
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, num_classes or (10 if cifar else 1000))

    def forward(self, x):
        x = self.relu(self.bn1(self.conv1(x)))
        if self.maxpool is not None:
            x = self.maxpool(x)
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class ResNet18(ResNet):
    """ResNet-18, CIFAR variant: 3x3 stem, no max-pool (the zoo's resnet18-cifar)."""

    def __init__(self, num_classes: int = 10):
        super().__init__(BasicBlock, (2, 2, 2, 2), cifar=True, num_classes=num_classes)


class InvertedResidual(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, expand: int):
        super().__init__()
        hidden = cin * expand
        self.expand = self.expand_bn = self.expand_relu = None
        if expand != 1:
            self.expand, self.expand_bn = _conv_bn(cin, hidden, 1)
            self.expand_relu = nn.ReLU6()
        self.dw, self.dw_bn = _conv_bn(hidden, hidden, 3, stride, groups=hidden)
        self.dw_relu = nn.ReLU6()
        self.project, self.project_bn = _conv_bn(hidden, cout, 1)
        self.residual = stride == 1 and cin == cout

    def forward(self, x):
        y = x
        if self.expand is not None:
            y = self.expand_relu(self.expand_bn(self.expand(y)))
        y = self.dw_relu(self.dw_bn(self.dw(y)))
        y = self.project_bn(self.project(y))
        return x + y if self.residual else y


class MobileNetV2(nn.Module):
    """MobileNetV2 width 1.0 (the zoo's mobilenetv2)."""

    def __init__(self, num_classes: int = 1000):
        super().__init__()
        self.stem = nn.Sequential()
        self.stem.conv, self.stem.bn = _conv_bn(3, 32, 3, 2)
        self.stem.relu = nn.ReLU6()
        blocks, cin = [], 32
        for t, c, n, s in ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2),
                           (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1)):
            for i in range(n):
                blocks.append(InvertedResidual(cin, c, s if i == 0 else 1, t))
                cin = c
        for k, block in enumerate(blocks):
            setattr(self, f"block{k}", block)
        self.num_blocks = len(blocks)
        self.head = nn.Sequential()
        self.head.conv, self.head.bn = _conv_bn(cin, 1280, 1)
        self.head.relu = nn.ReLU6()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(1280, num_classes)

    def forward(self, x):
        x = self.stem(x)
        for k in range(self.num_blocks):
            x = getattr(self, f"block{k}")(x)
        x = self.head(x)
        return self.classifier(torch.flatten(self.avgpool(x), 1))


class EncoderBlock(nn.Module):
    """One post-LN encoder block (as BERT) with fused scaled-dot-product attention. Input: hidden
    states (batch, seq, d_model)."""

    def __init__(self, d_model: int = 768, heads: int = 12, d_ff: int = 3072):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v = (nn.Linear(d_model, d_model) for _ in range(3))
        self.out = nn.Linear(d_model, d_model)
        self.attn_ln = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, d_ff)
        self.gelu = nn.GELU()
        self.fc2 = nn.Linear(d_ff, d_model)
        self.ffn_ln = nn.LayerNorm(d_model)

    def _split(self, t):
        b, s, d = t.shape
        return t.view(b, s, self.heads, d // self.heads).transpose(1, 2)

    def forward(self, x):
        b, s, d = x.shape
        ctx = F.scaled_dot_product_attention(self._split(self.q(x)), self._split(self.k(x)), self._split(self.v(x)))
        x = self.attn_ln(x + self.out(ctx.transpose(1, 2).reshape(b, s, d)))
        return self.ffn_ln(x + self.fc2(self.gelu(self.fc1(x))))


def resnet18() -> nn.Module:
    torch.manual_seed(0)
    return ResNet18()


def mobilenetv2() -> nn.Module:
    torch.manual_seed(0)
    return MobileNetV2()


def transformer_block() -> nn.Module:
    torch.manual_seed(0)
    return EncoderBlock()


class TinyCnn(nn.Module):
    """A microcontroller-sized CNN with every operator the firmware kernels train: convolution,
    depthwise convolution, batch norm, ReLU6, a residual add, max and global average pooling and a
    linear head (input 1x3x32x32 or any batch of 3-channel images)."""

    def __init__(self, classes: int = 4):
        super().__init__()
        self.stem, self.stem_bn = _conv_bn(3, 8, 3, 2)
        self.stem_relu = nn.ReLU6()
        self.pool = nn.MaxPool2d(2, 2)
        self.dw, self.dw_bn = _conv_bn(8, 8, 3, groups=8)
        self.dw_relu = nn.ReLU6()
        self.pw, self.pw_bn = _conv_bn(8, 8, 1)
        self.head, self.head_bn = _conv_bn(8, 16, 3, 2)
        self.head_relu = nn.ReLU()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, classes)

    def forward(self, x):
        x = self.pool(self.stem_relu(self.stem_bn(self.stem(x))))
        y = self.pw_bn(self.pw(self.dw_relu(self.dw_bn(self.dw(x)))))
        x = x + y
        x = self.head_relu(self.head_bn(self.head(x)))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def tiny_cnn() -> nn.Module:
    torch.manual_seed(0)
    return TinyCnn()


class WideMlp(nn.Module):
    """A multilayer perceptron whose weights are several times a microcontroller's RAM: eight
    ``width x width`` linear layers (about 100 KiB each at width 160) and a small classifier, so
    training it on a 256 KiB part needs streamed weights (``--weights streamed``)."""

    def __init__(self, width: int = 160, depth: int = 8, classes: int = 10):
        super().__init__()
        layers: list[nn.Module] = []
        for k in range(depth):
            layers += [nn.Linear(width, width), nn.ReLU()]
        self.body = nn.Sequential(*layers)
        self.fc = nn.Linear(width, classes)

    def forward(self, x):
        return self.fc(self.body(x))


def wide_mlp() -> nn.Module:
    torch.manual_seed(0)
    return WideMlp()


class StreamedCnn(nn.Module):
    """A small CNN for streamed weights: convolution, batch norm, ReLU, a depthwise convolution,
    global average pooling and a linear head (input N x 3 x 16 x 16)."""

    def __init__(self, classes: int = 4):
        super().__init__()
        self.conv1, self.bn1 = _conv_bn(3, 8, 3, 2)
        self.relu1 = nn.ReLU()
        self.dw = nn.Conv2d(8, 8, 3, 1, 1, groups=8)
        self.relu2 = nn.ReLU()
        self.conv2 = nn.Conv2d(8, 16, 3, 2, 1)
        self.relu3 = nn.ReLU()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, classes)

    def forward(self, x):
        x = self.relu1(self.bn1(self.conv1(x)))
        x = self.relu2(self.dw(x))
        x = self.relu3(self.conv2(x))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def streamed_cnn() -> nn.Module:
    torch.manual_seed(0)
    return StreamedCnn()


class TiledCnn(nn.Module):
    """A CNN with one layer whose weights alone exceed a 256 KiB part's RAM: ``fc1``, 768 x 96
    (288 KiB), so it trains on the nRF52840 only as tiles of its weights (``--weight-tile``). conv3
    (54 KiB, with a bias before its batch norm) tiles too at a small tile size. Input N x 3 x 16 x 16."""

    def __init__(self, classes: int = 4):
        super().__init__()
        self.conv1, self.bn1 = _conv_bn(3, 16, 3, 2)
        self.relu1 = nn.ReLU()
        self.conv2, self.bn2 = _conv_bn(16, 32, 3, 2)
        self.relu2 = nn.ReLU()
        self.conv3, self.bn3 = nn.Conv2d(32, 48, 3, 1, 1), nn.BatchNorm2d(48)
        self.relu3 = nn.ReLU()
        self.fc1 = nn.Linear(48 * 4 * 4, 96)
        self.relu4 = nn.ReLU()
        self.fc = nn.Linear(96, classes)

    def forward(self, x):
        x = self.relu1(self.bn1(self.conv1(x)))
        x = self.relu2(self.bn2(self.conv2(x)))
        x = self.relu3(self.bn3(self.conv3(x)))
        return self.fc(self.relu4(self.fc1(torch.flatten(x, 1))))


def tiled_cnn() -> nn.Module:
    torch.manual_seed(0)
    return TiledCnn()


class StripCnn(nn.Module):
    """A CNN whose first activations do not fit a 256 KiB part whole: at 1 x 1 x 96 x 96 the
    stem's output is 288 KiB, so it trains on the nRF52840 only with its activations split into
    strips along H (docs/streaming.md). It has every operator the strip kernels run: convolutions
    of stride 1 and 2, a depthwise and a 1x1 convolution with a bias, batch norm, ReLU, max and
    average pooling, a residual add, global average pooling and a linear head."""

    def __init__(self, classes: int = 4):
        super().__init__()
        self.stem, self.stem_bn = _conv_bn(1, 8, 3)
        self.stem_relu = nn.ReLU()
        self.pool = nn.MaxPool2d(3, 2, 1)
        self.dw, self.dw_bn = _conv_bn(8, 8, 3, groups=8)
        self.dw_relu = nn.ReLU()
        self.pw = nn.Conv2d(8, 8, 1)
        self.head, self.head_bn = _conv_bn(8, 16, 3, 2)
        self.head_relu = nn.ReLU()
        self.avg = nn.AvgPool2d(2, 2)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, classes)

    def forward(self, x):
        x = self.pool(self.stem_relu(self.stem_bn(self.stem(x))))
        x = x + self.pw(self.dw_relu(self.dw_bn(self.dw(x))))
        x = self.avg(self.head_relu(self.head_bn(self.head(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def strip_cnn() -> nn.Module:
    torch.manual_seed(0)
    return StripCnn()


class EncoderClassifier(nn.Module):
    """One post-LN encoder block written out by hand (no fused attention): linear Q, K and V split
    into heads by view and transpose, softmax attention by matmul, residual adds, layer norms, a
    GELU feed-forward, and a classification head on the mean over tokens. Its weights (3 MB at d
    256) cannot be resident on a 256 KiB part, nor its attention scores whole: at 1 x 64 x 256 it
    trains on the nRF52840 only with its tokens in row blocks (docs/streaming.md, issue 27)."""

    def __init__(self, d: int = 256, h: int = 4, ff: int = 1024, classes: int = 10):
        super().__init__()
        self.h = h
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.fc1, self.act, self.fc2 = nn.Linear(d, ff), nn.GELU(), nn.Linear(ff, d)
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        b, s, d = x.shape
        q = self.q(x).view(b, s, self.h, d // self.h).transpose(1, 2)
        k = self.k(x).view(b, s, self.h, d // self.h).transpose(1, 2)
        v = self.v(x).view(b, s, self.h, d // self.h).transpose(1, 2)
        a = torch.softmax(q @ k.transpose(-2, -1) / (d // self.h) ** 0.5, dim=-1)
        ctx = (a @ v).transpose(1, 2).reshape(b, s, d)
        x = self.ln1(x + self.o(ctx))
        x = self.ln2(x + self.fc2(self.act(self.fc1(x))))
        return self.head(x.mean(dim=1))


def encoder_classifier() -> nn.Module:
    torch.manual_seed(0)
    return EncoderClassifier()


def small_encoder_classifier() -> nn.Module:
    """The same block at d 32, 2 heads, FFN 64: row tiles in seconds, for tests."""
    torch.manual_seed(0)
    return EncoderClassifier(d=32, h=2, ff=64, classes=4)


class TokenClassifier(EncoderClassifier):
    """The encoder block on token ids: a word embedding (a table of ``vocab`` rows) before it, as a
    text classifier starts. `poet-opt run` trains it from integer ids in --data's x."""

    def __init__(self, vocab: int = 100, d: int = 32, h: int = 2, ff: int = 64, classes: int = 4):
        super().__init__(d=d, h=h, ff=ff, classes=classes)
        self.embed = nn.Embedding(vocab, d)

    def forward(self, ids):
        return super().forward(self.embed(ids))


def small_token_classifier() -> nn.Module:
    """A 100-word table, then the small block (d 32, 2 heads, FFN 64): for tests and the docs."""
    torch.manual_seed(0)
    return TokenClassifier()
