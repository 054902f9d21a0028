"""A sample's tree: flattening a sample into its leaf fields and its container structure, naming the fields by
their paths, and ``fold``, the one walker over a structure tree (the builders, the checker, the describer and the
format's validation are callbacks passed to it). See ``format.layout`` for what a layout is.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, TypeVar

from ..errors import LayoutError
from .fields import JSON, MAX_DEPTH, MAX_DIMS, PYLIST, Field, Leaf, number_list, typed_leaf

__all__ = ["describe_structure", "flatten", "fold", "route"]


def _is_namedtuple(obj: Any) -> bool:
    return isinstance(obj, tuple) and hasattr(type(obj), "_fields")


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def flatten(sample: Any) -> tuple[Any, list[Leaf]]:
    """Splits a sample into its structure (JSON-able) and its leaves, in field order: the structure's leaves,
    then one metadata leaf per tensor subclass leaf.

    This walks the source's objects, not a structure tree, so it is the one walker ``fold`` does not express.

    Raises:
        LayoutError: a leaf of an unsupported type, or containers nested deeper than ``MAX_DEPTH``, naming the
            field path and a fix.
    """
    leaves: list[Leaf] = []
    structure = _flatten(sample, "", leaves, 0)
    for number in range(len(leaves)):
        leaf = leaves[number]
        if leaf.meta is not None:
            meta_field = Field(f"{leaf.field.name}#meta", JSON, "|u1", (-1,), ragged=True)
            leaves[number] = Leaf(replace(leaf.field, metadata=len(leaves)), leaf.value)
            leaves.append(Leaf(meta_field, leaf.meta))
    return structure, leaves


def _flatten(obj: Any, path: str, leaves: list[Leaf], depth: int) -> Any:
    if type(obj) is list and (obj or path):  # a whole sample of [] has no field: refused as such
        numbers = number_list(obj)
        if numbers is not None:  # one array field, not one field per number (Hugging Face's python format)
            if depth + numbers.ndim > MAX_DEPTH:
                raise LayoutError(_too_deep(path))
            return _append(leaves, Leaf(Field(path or "<sample>", PYLIST, numbers.dtype.str, numbers.shape), numbers))
    if isinstance(obj, (tuple, list, dict)):
        depth += 1
        if depth > MAX_DEPTH:
            raise LayoutError(_too_deep(path))
    if _is_namedtuple(obj):
        cls = type(obj)
        items = [_flatten(v, _join(path, str(i)), leaves, depth) for i, v in enumerate(obj)]
        return {"namedtuple": [cls.__module__, cls.__qualname__, list(cls._fields)], "items": items}
    if isinstance(obj, (tuple, list)):
        kind = "tuple" if isinstance(obj, tuple) else "list"
        return {kind: [_flatten(v, _join(path, str(i)), leaves, depth) for i, v in enumerate(obj)]}
    if isinstance(obj, dict):
        items = []
        for key, value in obj.items():
            if not isinstance(key, str):
                raise LayoutError(
                    f"field {path or '<sample>'!r}: dict key {key!r} is a {type(key).__name__}, expected str; "
                    "use string keys in the samples of the wrapped dataset"
                )
            items.append([key, _flatten(value, _join(path, key), leaves, depth)])
        return {"dict": items}
    return _append(leaves, typed_leaf(obj, path or "<sample>"))


def _append(leaves: list[Leaf], leaf: Leaf) -> dict[str, int]:
    if len(leaf.field.shape) > MAX_DIMS:
        raise LayoutError(f"field {leaf.field.name!r}: an array of {len(leaf.field.shape)} dimensions (the limit is "
                          f"{MAX_DIMS}); reshape it in the wrapped dataset")
    leaves.append(leaf)
    return {"leaf": len(leaves) - 1}


def _too_deep(path: str) -> str:
    shown = path if len(path) <= 80 else path[:80] + "..."
    return (f"field {shown or '<sample>'!r}: containers nested deeper than {MAX_DEPTH} levels (the limit, which also "
            "stops a self-containing list); flatten the sample in the wrapped dataset, e.g. stack the innermost "
            "lists into a tensor or join keys into one dict level")


def route(structure: Any, number: int) -> str:
    """How to reach leaf ``number`` from the sample, unambiguously: ``sample['a.b']`` or ``sample['a']['b']``."""
    def leaf(index: int, *_: Any) -> list[str] | None:
        return [] if index == number else None

    def find(keys: Sequence[Any], parts: list[list[str] | None]) -> list[str] | None:
        for key, part in zip(keys, parts):
            if part is not None:
                return [f"[{key!r}]", *part]
        return None

    route = fold(structure, leaf=leaf,
                 sequence=lambda kind, parts, children: find(range(len(parts)), parts),
                 mapping=lambda keys, parts, children: find(keys, parts),
                 record=lambda spec, parts, children: find(range(len(parts)), parts))
    return "sample" + "".join(route or [])


def describe_structure(structure: Any) -> str:
    """A short human form of a structure: ``tuple(leaf, leaf)``, ``dict(image: leaf, label: leaf)``."""
    return fold(
        structure,
        leaf=lambda index: "leaf",
        sequence=lambda kind, parts, children: f"{kind}({', '.join(parts)})",
        mapping=lambda keys, parts, children: "dict(" + ", ".join(f"{k}: {p}" for k, p in zip(keys, parts)) + ")",
        record=lambda spec, parts, children: f"{spec[1]}({', '.join(spec[2])})",
    )


T = TypeVar("T")


def fold(
    structure: Any,
    *,
    leaf: Callable[[int], T],
    sequence: Callable[[str, list[T], list[Any]], T],
    mapping: Callable[[list[str], list[T], list[Any]], T],
    record: Callable[[tuple[str, str, list[str]], list[T], list[Any]], T],
) -> T:
    """Folds a structure tree bottom-up: each node becomes what its kind's callback makes of its children's results.

    The tree is the one in ``meta.json`` (see ``format.spec``): ``{"leaf": n}``, ``{"tuple": [...]}``,
    ``{"list": [...]}``, ``{"dict": [[key, node], ...]}`` and ``{"namedtuple": [module, qualname, names],
    "items": [...]}``. Each container callback also receives its child nodes, so a builder can take a fast path
    for, say, a tuple of bare leaves.

    Args:
        structure: the root node.
        leaf: ``leaf(field_number)``.
        sequence: ``sequence(kind, parts, children)``, kind ``"tuple"`` or ``"list"``.
        mapping: ``mapping(keys, parts, children)`` for a dict, keys in order.
        record: ``record((module, qualname, names), parts, children)`` for a namedtuple.

    Raises:
        ValueError: a node of unknown shape (only a damaged ``meta.json`` has one).
        LayoutError: containers nested deeper than ``MAX_DEPTH``.
    """
    def visit(node: Any, depth: int) -> T:
        if type(node) is not dict:
            raise ValueError(f"structure node {node!r} is not an object")
        keys = node.keys()
        if keys == {"leaf"}:
            index = node["leaf"]
            if type(index) is not int:
                raise ValueError(f"leaf {index!r} is not a field number")
            return leaf(index)
        if depth >= MAX_DEPTH:
            raise LayoutError(f"a structure nests containers deeper than {MAX_DEPTH} levels, the limit")
        if keys == {"tuple"} or keys == {"list"}:
            kind = "tuple" if "tuple" in keys else "list"
            children = _children(node[kind], node)
            return sequence(kind, [visit(c, depth + 1) for c in children], children)
        if keys == {"dict"}:
            pairs = _children(node["dict"], node)
            if not all(type(p) is list and len(p) == 2 and type(p[0]) is str for p in pairs):
                raise ValueError("a dict node must list [key, node] pairs with string keys")
            children = [p[1] for p in pairs]
            return mapping([p[0] for p in pairs], [visit(c, depth + 1) for c in children], children)
        if keys == {"namedtuple", "items"}:
            spec = node["namedtuple"]
            if type(spec) is not list or len(spec) != 3:
                raise ValueError(f"bad namedtuple description {spec!r}")
            children = _children(node["items"], node)
            return record((spec[0], spec[1], spec[2]), [visit(c, depth + 1) for c in children], children)
        raise ValueError(f"unknown structure node with keys {sorted(keys)}")

    return visit(structure, 0)


def _children(children: Any, node: Any) -> list[Any]:
    if type(children) is not list:
        raise ValueError(f"structure node {node!r} does not list its children")
    return children
