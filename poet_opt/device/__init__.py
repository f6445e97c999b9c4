"""Device stage: hardware profiles (compute, memory and storage figures from YAML) and the cost
model that turns a training graph into per-node energy and time for compute, page-in and page-out."""
