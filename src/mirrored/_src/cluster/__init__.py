"""Where this process sits in a multi-worker job: `ClusterSpec` (frozen data), the pure
parsers of ``TF_CONFIG`` and torchrun's variables, and the cluster resolvers over them."""
