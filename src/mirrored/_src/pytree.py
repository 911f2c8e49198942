"""Every pytree operation of the library, over `optree`.

Containers (lists, tuples, namedtuples, dicts and dataclasses) are nodes;
distributed values (`PerReplica`, `Mirrored`) and tensors are leaves. Plain
dataclasses, and subclasses of ``dict`` and ``list`` (TF's ``nest`` keeps them as
containers too), are registered in the library's own optree namespace the first
time one is seen, so user code needs no registration.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Callable, Sequence
from typing import Any

import optree

__all__ = [
    "PyTreeSpec",
    "first_difference",
    "flatten",
    "flatten_with_path",
    "format_path",
    "register_leaf_type",
    "tree_map",
    "unflatten",
]

NAMESPACE = "mirrored"
PyTreeSpec = optree.PyTreeSpec

_leaf_types: tuple[type, ...] = ()
_registered: set[type] = set()
_register_lock = threading.Lock()
# type -> whether its instances are leaves by our rule; filled on first sight.
_is_leaf_type: dict[type, bool] = {}


def register_leaf_type(cls: type) -> None:
    """Makes instances of ``cls`` (and subclasses) leaves, never nodes."""
    global _leaf_types
    _leaf_types = (*_leaf_types, cls)
    _is_leaf_type.clear()


def _register_dataclass(cls: type) -> None:
    fields = dataclasses.fields(cls)
    names = tuple(f.name for f in fields)
    init = frozenset(f.name for f in fields if f.init)

    def flatten_fn(obj: Any) -> tuple[tuple[Any, ...], tuple[str, ...], tuple[str, ...]]:
        return tuple(getattr(obj, n) for n in names), names, names

    def unflatten_fn(meta: Any, children: Any) -> Any:
        values = dict(zip(meta, children, strict=True))
        obj = cls(**{n: v for n, v in values.items() if n in init})
        for name, value in values.items():  # fields with init=False keep their values
            if name not in init:
                object.__setattr__(obj, name, value)
        return obj

    with _register_lock:
        if cls not in _registered:
            optree.register_pytree_node(
                cls,
                flatten_fn,
                unflatten_fn,
                namespace=NAMESPACE,
                path_entry_type=optree.GetAttrEntry,
            )
            _registered.add(cls)


_NATIVE = (dict, list, collections.OrderedDict, collections.defaultdict)


def _is_container_subclass(cls: type) -> bool:
    """A user's subclass of ``dict`` or ``list``, which optree would treat as a leaf."""
    return issubclass(cls, dict | list) and cls not in _NATIVE and not issubclass(
        cls, collections.OrderedDict | collections.defaultdict)


def _sorted_keys(obj: dict[Any, Any]) -> tuple[Any, ...]:
    try:
        return tuple(sorted(obj))  # as optree orders a dict's keys
    except TypeError:
        return tuple(obj)


def _rebuild(cls: Any, items: Any) -> Any:
    """``cls(items)``, as TF's nest rebuilds a container; for a constructor with another
    signature, an empty instance filled through the base class."""
    try:
        return cls(items)
    except TypeError:
        obj = cls.__new__(cls)
        if isinstance(obj, dict):
            dict.update(obj, items)
        else:
            list.extend(obj, items)
        return obj


def _register_container(cls: type) -> None:
    mapping = issubclass(cls, dict)

    def flatten_fn(obj: Any) -> tuple[tuple[Any, ...], Any, tuple[Any, ...]]:
        if mapping:
            keys = _sorted_keys(obj)
            return tuple(obj[k] for k in keys), keys, keys
        return tuple(obj), len(obj), tuple(range(len(obj)))

    def unflatten_fn(meta: Any, children: Any) -> Any:
        if mapping:
            return _rebuild(cls, list(zip(meta, children, strict=True)))
        return _rebuild(cls, list(children))

    entry: type = optree.MappingEntry if mapping else optree.SequenceEntry
    with _register_lock:
        if cls not in _registered:
            optree.register_pytree_node(cls, flatten_fn, unflatten_fn,
                                        namespace=NAMESPACE, path_entry_type=entry)
            _registered.add(cls)


def _is_leaf(x: Any) -> bool:
    cls = type(x)
    known = _is_leaf_type.get(cls)
    if known is not None:
        return known
    leaf = issubclass(cls, _leaf_types)
    if not leaf and cls not in _registered:
        if dataclasses.is_dataclass(cls):
            _register_dataclass(cls)
        elif _is_container_subclass(cls):
            _register_container(cls)
    _is_leaf_type[cls] = leaf
    return leaf


# Leaf types seen that need no registration: the fast path flattens in C, without a
# Python is_leaf callback per node, and only falls back when a new type shows up.
_plain_types: set[type] = set()


def _all_registered(leaves: list[Any]) -> bool:
    """Whether no leaf is an instance of a dataclass (or dict or list subclass) still to
    be registered as a node."""
    new = {type(leaf) for leaf in leaves} - _plain_types
    for cls in new:
        if (dataclasses.is_dataclass(cls) or _is_container_subclass(cls)) and \
                cls not in _registered and not issubclass(cls, _leaf_types):
            return False
        _plain_types.add(cls)
    return True


def flatten(tree: Any) -> tuple[list[Any], PyTreeSpec]:
    """Returns the leaves of ``tree`` in a fixed order and its structure."""
    leaves, spec = optree.tree_flatten(tree, namespace=NAMESPACE)
    if _all_registered(leaves):
        return leaves, spec
    return optree.tree_flatten(tree, is_leaf=_is_leaf, namespace=NAMESPACE)


def unflatten(spec: PyTreeSpec, leaves: Sequence[Any]) -> Any:
    """Rebuilds a tree of structure ``spec`` from ``leaves``."""
    return optree.tree_unflatten(spec, leaves)


def flatten_with_path(tree: Any) -> tuple[list[tuple[Any, ...]], list[Any], PyTreeSpec]:
    """Like `flatten`, with the path (tuple of keys) of each leaf."""
    flatten(tree)  # registers the dataclasses inside
    return optree.tree_flatten_with_path(tree, namespace=NAMESPACE)


def tree_map(fn: Callable[..., Any], tree: Any, *rest: Any) -> Any:
    """Applies ``fn`` leaf-wise to ``tree`` and trees of the same structure."""
    leaves, spec = flatten(tree)
    if not rest:
        return optree.tree_unflatten(spec, [fn(leaf) for leaf in leaves])
    others = [spec.flatten_up_to(other) for other in rest]
    return optree.tree_unflatten(spec, [fn(*xs) for xs in zip(leaves, *others, strict=True)])


def format_path(path: Sequence[Any], root: str = "value") -> str:
    """``('a', 0)`` -> ``"value['a'][0]"``; the root itself is ``"value"``."""
    return root + "".join(f"[{key!r}]" for key in path)


def _node_description(tree: Any) -> str:
    if _is_leaf(tree) or optree.tree_is_leaf(tree, is_leaf=_is_leaf, namespace=NAMESPACE):
        return f"a leaf ({type(tree).__name__})"
    if tree is None:
        return "None"
    children = optree.tree_flatten_one_level(tree, is_leaf=_is_leaf, namespace=NAMESPACE)[0]
    name = type(tree).__name__
    article = "an" if name[:1].lower() in "aeiou" else "a"
    return f"{article} {name} of {len(children)}"


def first_difference(a: Any, b: Any, root: str = "value") -> tuple[str, str, str] | None:
    """Finds where two trees' structures first differ.

    Returns:
        ``None`` if the structures match, else ``(path, what a has, what b has)``.
    """

    def walk(x: Any, y: Any, path: tuple[Any, ...]) -> tuple[str, str, str] | None:
        x_leaf = optree.tree_is_leaf(x, is_leaf=_is_leaf, namespace=NAMESPACE)
        y_leaf = optree.tree_is_leaf(y, is_leaf=_is_leaf, namespace=NAMESPACE)
        if x_leaf and y_leaf:
            return None
        here = (format_path(path, root), _node_description(x), _node_description(y))
        if x_leaf != y_leaf or type(x) is not type(y):
            return here
        xs = optree.tree_flatten_one_level(x, is_leaf=_is_leaf, namespace=NAMESPACE)
        ys = optree.tree_flatten_one_level(y, is_leaf=_is_leaf, namespace=NAMESPACE)
        x_children, x_meta, x_entries = xs[0], xs[1], xs[2]
        y_children, y_meta, y_entries = ys[0], ys[1], ys[2]
        if tuple(x_entries) != tuple(y_entries) or len(x_children) != len(y_children):
            missing = [e for e in x_entries if e not in y_entries]
            extra = [e for e in y_entries if e not in x_entries]
            if missing or extra:
                key = (missing or extra)[0]
                where = format_path((*path, key), root)
                x_map = dict(zip(x_entries, x_children, strict=True))
                y_map = dict(zip(y_entries, y_children, strict=True))
                has_x = _node_description(x_map[key]) if key in x_map else "nothing"
                has_y = _node_description(y_map[key]) if key in y_map else "nothing"
                return (where, has_x, has_y)
            if len(x_children) == len(y_children):  # same keys, another order
                return (here[0], f"{here[1]} with keys in the order {list(x_entries)}",
                        f"{here[2]} with keys in the order {list(y_entries)}")
            return here
        if x_meta != y_meta:
            if isinstance(x_meta, tuple | list) and isinstance(y_meta, tuple | list) and sorted(
                    map(repr, x_meta)) == sorted(map(repr, y_meta)):
                return (here[0], f"{here[1]} with keys in the order {list(x_meta)}",
                        f"{here[2]} with keys in the order {list(y_meta)}")
            return here
        for entry, cx, cy in zip(x_entries, x_children, y_children, strict=True):
            found = walk(cx, cy, (*path, entry))
            if found is not None:
                return found
        return None

    return walk(a, b, ())
