"""Example networks in plain PyTorch for the importers (``--torch poet_opt.examples.torch_models:resnet18``)."""
