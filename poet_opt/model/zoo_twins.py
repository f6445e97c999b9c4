"""PyTorch modules for the zoo's models, layer for layer as the zoo builds them (same operators,
shapes and names; a test lowers each to the zoo's graph node for node), with PyTorch's default
initialisation under ``torch.manual_seed(SEED)``: `poet-opt emulate --model NAME` and `run --model
NAME` train these. The zoo keeps its own builders because `solve --model` works without PyTorch."""

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


FACTORIES = {"mcu-vww": _mcu_vww, "mlp": _mlp, "mlp-residual": _mlp_residual, "vgg16-cifar": _vgg16(imagenet=False),
             "vgg16-imagenet": _vgg16(imagenet=True),
             "resnet18-cifar": _example("resnet18"), "mobilenetv2": _example("mobilenetv2"),
             "resnet18-imagenet": _resnet((2, 2, 2, 2), bottleneck=False),
             "resnet50": _resnet((3, 4, 6, 3), bottleneck=True)}


def zoo_module(name: str):
    """The seeded PyTorch module of zoo model ``name``."""
    key = str(name).strip().lower()
    if key not in FACTORIES:
        raise PoetError(f"no PyTorch twin of zoo model {name!r} yet; train one of {', '.join(sorted(FACTORIES))}, "
                        "or give --torch FILE.py:FACTORY", field="--model")
    return FACTORIES[key]()
