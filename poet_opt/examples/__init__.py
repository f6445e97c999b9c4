"""Example networks in plain PyTorch for the importers (``--torch poet_opt.examples.torch_models:resnet18``),
and the digits fine-tuning walkthrough (``python -m poet_opt.examples.digits``, docs/firmware.md)."""
