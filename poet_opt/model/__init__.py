"""Model stage: the training graph (forward, loss and backward nodes with their sizes and FLOPs) and
every place it can come from: the zoo, node-link JSON, PyTorch and ONNX, random graphs, the
optimizer step and measured per-layer costs."""
