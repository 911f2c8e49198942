"""Inductor's CPU kernels called without the GIL, so replicas' compiled steps overlap.

``torch.compile`` turns a graph on CPU tensors into C++ kernels that Inductor calls
through a small CPython binding (``CppPythonBindingsCodeCache`` in
``torch._inductor.codecache``). That binding keeps the GIL for the kernel's whole
run. An eager op releases it, so two replica threads' eager steps share the two
cores; their compiled steps ran one kernel at a time. On the benchmark's 2-block
GPT (``benchmarks/bench_random.py``, 2 replicas, 2 cores) the compiled step took
1.37x the eager one, and 1.24x plain torch's compiled step on the same two batches;
with the kernels called without the GIL, 1.03x and 0.86x.

The binding's call is one format string on the class. :func:`release_gil` replaces
it with one that parses the arguments with the GIL held (they are Python objects),
then calls the kernel without it and takes it back on return or on an exception
(a C++ guard object). A kernel is C++ over data pointers (loops, OpenMP, Inductor's
own random numbers), with no Python in it. One thing in it is not thread-safe: at its
start it points a global of its module at a flag on its own stack, for an integer
division by zero, and clears it at its end; so one kernel runs on one thread at a
time (a mutex per kernel module), and different kernels run at once, which is where
two replicas' steps overlap. The C++ wrapper mode
(``CppWrapperCodeCache``, which builds Python results) keeps its own string, and
so does any other subclass that inherits the original.

It is applied once per process, when the first runtime of several CPU replicas is
made: at once if Inductor's code cache is already imported, otherwise when it is
(``lazy_torch.when_imported``), so the library never imports Inductor. Only
kernels built after that release the GIL; the changed source gives them other cache
keys than kernels built before. A torch whose string differs from the one this was
written for is left as it is (``state()`` says which).
"""

from __future__ import annotations

import threading
from types import ModuleType

from ..lazy_torch import when_imported

__all__ = ["release_gil", "state"]

_MODULE = "torch._inductor.codecache"
_ORIGINAL = "kernel({}); Py_RETURN_NONE;"
# The arguments are evaluated (parse_arg, under the GIL) before the lambda's body runs;
# the guard releases the GIL for the kernel and restores it on the way out, and a lock
# per kernel (a static of this module's one binding) keeps two threads out of the same
# kernel at once: it points a global of its module at a flag on its stack for integer
# division by zero, so two runs of one kernel would report into each other's frames.
# Only what Python.h declares (the binding includes it): the lock is CPython's own
# (pythread.h), not std::mutex, whose <mutex> torch 2.11's kernel source lacks (every
# compile failed there).
_WITHOUT_GIL = (
    "{{ struct MirroredReleasedGil {{ PyThreadState* state = PyEval_SaveThread(); "
    "~MirroredReleasedGil() {{ PyEval_RestoreThread(state); }} }}; "
    "static PyThread_type_lock mirrored_one_at_a_time = PyThread_allocate_lock(); "
    "struct MirroredAlone {{ MirroredAlone() {{ if (mirrored_one_at_a_time) "
    "PyThread_acquire_lock(mirrored_one_at_a_time, WAIT_LOCK); }} "
    "~MirroredAlone() {{ if (mirrored_one_at_a_time) "
    "PyThread_release_lock(mirrored_one_at_a_time); }} }}; "
    "[](auto... arg) {{ MirroredReleasedGil released; MirroredAlone alone; "
    "kernel(arg...); }}({}); }} "
    "Py_RETURN_NONE;")

_lock = threading.Lock()
_state = "not applied"


def state() -> str:
    """``"not applied"``, ``"waiting for import"``, ``"applied"`` or
    ``"unrecognised"`` (this torch's binding is not the one expected: left as is)."""
    return _state


def release_gil() -> None:
    """Makes Inductor's CPU kernels built from now on run without the GIL.

    Idempotent; never imports Inductor (see the module docstring).

    Example:
        >>> from mirrored._src.runtime import compiled_kernels
        >>> compiled_kernels.release_gil()
        >>> compiled_kernels.state() in ("applied", "waiting for import", "unrecognised")
        True
    """
    global _state
    with _lock:
        if _state != "not applied":
            return
        _state = "waiting for import"
    when_imported(_MODULE, _patch)


def _patch(module: ModuleType) -> None:
    global _state
    cls = getattr(module, "CppPythonBindingsCodeCache", None)
    if cls is None or getattr(cls, "call_entry_function", None) != _ORIGINAL:
        _state = "unrecognised"
        return
    for sub in cls.__subclasses__():  # (those inheriting the string keep the original)
        if "call_entry_function" not in vars(sub):
            sub.call_entry_function = _ORIGINAL
    cls.call_entry_function = _WITHOUT_GIL
    _state = "applied"
