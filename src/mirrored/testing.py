"""Helpers for testing multi-worker code on one machine."""

from ._src.testing import MultiProcessError as MultiProcessError
from ._src.testing import find_free_port as find_free_port
from ._src.testing import run_multi_process as run_multi_process

__all__ = ["MultiProcessError", "find_free_port", "run_multi_process"]
