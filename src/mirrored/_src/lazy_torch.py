"""Adapting to parts of torch that the library must not import (Dynamo costs 0.7 s to
import, Inductor more).

``skip_in_dynamo(fn)``: Dynamo neither traces nor inlines ``fn``. Through torch's C
extension and one attribute, as ``torch._dynamo.skip`` does: the frame's execution
strategy (skip it; compile or skip what it calls) serves a frame that Dynamo's frame
hook meets (an eager call, or the code between compiled frames), and
``_torchdynamo_disable`` a call met while tracing a compiled frame, which becomes a
graph break in the caller's frame; without it Dynamo inlined the function (it ignores
the execution strategy when inlining).

``when_imported(name, callback)`` calls ``callback(module)``
at once if ``name`` is in ``sys.modules``, else right after the module's first import
has executed, through one finder at the front of ``sys.meta_path`` (put back there
at each call, ahead of finders inserted since) that finds the
module with the finders after it (the path finder, or a custom importer's) and wraps
its loader's ``exec_module``. The finder answers only the names waited for, and stays
in ``sys.meta_path`` when none is left (one dict probe per import): removing itself
while the import system iterated the list skipped the finder after it. A loader
without ``exec_module`` (the legacy ``load_module``) never calls back.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import sys
import threading
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

__all__ = ["skip_in_dynamo", "when_imported"]

_lock = threading.RLock()


def skip_in_dynamo(fn: Callable[..., Any], *, inside: bool = False, reason: str = "") -> None:
    """Dynamo skips ``fn`` (and compiles what it calls, or with ``inside`` runs all of
    that eagerly too), whether met by its frame hook or while tracing a caller; a
    torch without the C hook traces it. ``reason``: why, in Dynamo's message where a
    graph break is refused (``fullgraph=True``).

    Example:
        >>> def bookkeeping() -> None: ...
        >>> skip_in_dynamo(bookkeeping, inside=True)
        >>> bookkeeping._torchdynamo_disable
        True
    """
    fn._torchdynamo_disable = True  # type: ignore[attr-defined]
    if reason:  # (what Dynamo says where it cannot break the graph: fullgraph=True)
        fn._torchdynamo_disable_msg = reason  # type: ignore[attr-defined]
    try:
        from torch._C._dynamo.eval_frame import (
            _FrameAction,
            _FrameExecStrategy,
            set_code_exec_strategy,
        )
    except ImportError:  # pragma: no cover
        return
    inner = _FrameAction.SKIP if inside else _FrameAction.DEFAULT
    set_code_exec_strategy(fn.__code__, _FrameExecStrategy(_FrameAction.SKIP, inner))

_waiting: dict[str, list[Callable[[ModuleType], None]]] = {}


def when_imported(name: str, callback: Callable[[ModuleType], None]) -> None:
    """Calls ``callback(module)`` once ``name`` is imported (now, if it is).

    Example:
        >>> import sys
        >>> seen = []
        >>> when_imported("json", lambda module: seen.append(module.__name__))
        >>> import json
        >>> seen
        ['json']
    """
    with _lock:
        module = sys.modules.get(name)
        if module is None:
            _waiting.setdefault(name, []).append(callback)
            mine = [f for f in sys.meta_path if isinstance(f, _Finder)]
            if not mine or sys.meta_path[0] is not mine[0]:  # (at the front: first asked)
                for finder in mine:
                    sys.meta_path.remove(finder)
                sys.meta_path.insert(0, mine[0] if mine else _Finder())
            return
    callback(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _waiting:  # (the common case: one dict probe, no lock)
            return None
        with _lock:
            callbacks = _waiting.pop(fullname, None)
            finders = sys.meta_path[sys.meta_path.index(self) + 1:] if self in sys.meta_path else []
        if callbacks is None:
            return None
        spec = None
        for finder in finders:  # (the path finder, or a custom importer)
            find = getattr(finder, "find_spec", None)
            if find is not None and (spec := find(fullname, path, target)) is not None:
                break
        loader = spec.loader if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module"):
            if spec is None:  # (not found now: a later import may find it)
                with _lock:
                    _waiting.setdefault(fullname, []).extend(callbacks)
            return spec
        execute, own = loader.exec_module, getattr(loader, "__dict__", {}).get("exec_module")

        def exec_module(module: ModuleType) -> None:  # (once: a loader may be shared)
            if own is None:
                del loader.exec_module
            else:
                loader.exec_module = own
            execute(module)
            for callback in callbacks:
                callback(module)

        with contextlib.suppress(AttributeError):  # (a loader without attributes: no call back)
            loader.exec_module = exec_module
        return spec
