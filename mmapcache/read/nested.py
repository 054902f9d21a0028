"""A cache's batch regrouped as the samples nest it: a sample's dict (or tuple) of fields is stored as a field per
value, named by its path (``"meta.source"``, ``"meta.span.0"``), and a collate that builds its batch from those
fields (``TextCollate``'s cache paths) hands them back under the sample's key, as ``default_collate`` collates them
over the samples: ``{"meta": {"source": [...], "span": [tensor, tensor]}}``."""

from __future__ import annotations

from typing import Any

from ..format.codec import namedtuple_class
from ..format.tree import fold

__all__ = ["nested", "nested_fields"]

_ABSENT = object()  # a field the batch left out (``columns``), left out of its key's value too


def nested(reader: Any, batch: dict[str, Any]) -> dict[str, Any]:
    """A cache's batch with the fields of a sample's nested dicts and sequences under their key, as over the samples
    (``{"meta": {"src": [...], "n": tensor}}``, not ``"meta.src"``), in the key's place."""
    groups = _groups(reader)
    if not groups:
        return batch
    out: dict[str, Any] = {}
    for name, value in batch.items():
        group = groups.get(name)
        if group is None:
            out[name] = value
        elif group[0] not in out:
            out[group[0]] = group[1]({n: batch[n] for n in group[2] if n in batch})
    return out


def nested_fields(reader: Any) -> frozenset[str]:
    """The names of a cache's fields that lie under a nested key of the samples (``"meta.span"``), not keys of the
    samples' own."""
    return frozenset(_groups(reader))


_kept_groups: dict[int, tuple[Any, dict[str, Any]]] = {}


def _groups(reader: Any) -> dict[str, Any]:
    """Per field under a nested key of the samples: ``(key, build, its fields' names)``, ``build`` making the key's
    value from those fields' batched values by name; kept per layout."""
    layout = reader.store.layout
    kept = _kept_groups.get(id(layout))
    if kept is not None and kept[0] is layout:
        return kept[1]
    groups: dict[str, Any] = {}
    names = [field.name for field in reader.fields]
    for key, node in layout.structure.get("dict", []):
        if "leaf" not in node:
            tree = _tree(node, names)
            leaves = _leaves(tree)
            group = (key, lambda values, tree=tree: _built(tree, values), leaves)
            groups.update((name, group) for name in leaves)
    if len(_kept_groups) > 16:
        _kept_groups.clear()
    _kept_groups[id(layout)] = (layout, groups)
    return groups


def _tree(node: Any, names: list[str]) -> Any:
    """A structure node with its leaves' field names: a name, a list (a tuple or list: collated as a list, as
    ``default_collate`` collates a tuple), a ``_Record`` (a namedtuple) or a dict."""
    def leaf(n: int) -> Any:
        return names[n]

    def sequence(kind: str, parts: list[Any], children: list[Any]) -> Any:
        return parts

    def mapping(keys: list[str], parts: list[Any], children: list[Any]) -> Any:
        return dict(zip(keys, parts))

    def record(spec: Any, parts: list[Any], children: list[Any]) -> Any:
        return _Record(namedtuple_class(*spec), parts)

    return fold(node, leaf=leaf, sequence=sequence, mapping=mapping, record=record)


class _Record:
    """A namedtuple's node: its class and its parts' trees (kept a namedtuple, as ``default_collate`` keeps one)."""

    __slots__ = ("cls", "parts")

    def __init__(self, cls: type, parts: list[Any]) -> None:
        self.cls, self.parts = cls, parts


def _leaves(tree: Any) -> list[str]:
    if isinstance(tree, str):
        return [tree]
    parts = tree.values() if isinstance(tree, dict) else tree.parts if isinstance(tree, _Record) else tree
    return [name for part in parts for name in _leaves(part)]


def _built(tree: Any, values: dict[str, Any]) -> Any:
    """A nested key's value from its fields' batched values (the fields a batch left out are left out of it)."""
    if isinstance(tree, str):
        return values.get(tree, _ABSENT)
    kept: dict[str, Any] | list[Any]
    if isinstance(tree, dict):
        built = {key: _built(part, values) for key, part in tree.items()}
        kept = {key: value for key, value in built.items() if value is not _ABSENT}
    elif isinstance(tree, _Record):  # (whole, a namedtuple; a part of it left out, a list of the rest)
        kept = [value for value in (_built(part, values) for part in tree.parts) if value is not _ABSENT]
        if len(kept) == len(tree.parts):
            return tree.cls(*kept)
        return kept if kept else _ABSENT
    else:
        kept = [value for value in (_built(part, values) for part in tree) if value is not _ABSENT]
    return kept if kept or not tree else _ABSENT  # (a key none of whose fields the batch holds: left out too)
