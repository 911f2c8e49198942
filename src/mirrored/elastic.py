"""Elastic data parallelism on torchft (``pip install 'mirrored[elastic]'``): workers
that die are left out of the next step, restarted ones rejoin with a healthy peer's
state, without restarting the job. `ElasticMirroredStrategy` is the strategy (the
mirrored loop); `ElasticTrainer` a minimal loop helper for a plain module. See
docs/elastic.md."""

from ._src.elastic.lighthouse import Lighthouse as Lighthouse
from ._src.elastic.strategy import ElasticMirroredStrategy as ElasticMirroredStrategy
from ._src.elastic.trainer import ElasticTrainer as ElasticTrainer
from ._src.elastic.trainer import StepInfo as StepInfo

__all__ = ["ElasticMirroredStrategy", "ElasticTrainer", "Lighthouse", "StepInfo"]
