"""Elastic data parallelism on torchft: a per-step quorum of the live workers, a
fault-tolerant process group per quorum, and live recovery of a rejoining worker from
a healthy peer (torchft's `Manager`), with this library's batch semantics."""
