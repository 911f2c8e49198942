"""Elastic data parallelism on torchft (``pip install 'mirrored[elastic]'``): workers
that die are left out of the next step, restarted ones rejoin with a healthy peer's
state, without restarting the job. See docs/elastic.md."""

from ._src.elastic.lighthouse import Lighthouse as Lighthouse
from ._src.elastic.trainer import ElasticTrainer as ElasticTrainer
from ._src.elastic.trainer import StepInfo as StepInfo

__all__ = ["ElasticTrainer", "Lighthouse", "StepInfo"]
