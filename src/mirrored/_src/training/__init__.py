"""Training with torch modules: mirrored modules (one copy of a module per replica
device), mirrored optimizers (fused gradient all-reduce, every replica steps its
own copy) and cross-replica batch normalization."""
