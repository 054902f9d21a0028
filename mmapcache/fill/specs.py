"""Dataset specs: turning ``package.module:name`` or ``path/to/file.py:name`` plus JSON kwargs into a dataset.

A spec names a Dataset class or a factory function; calling it with the keyword arguments gives the source. The
spec string (not the dataset) is what crosses process boundaries, so every build worker makes its own copy.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from typing import Any

from ..errors import SpecError

__all__ = ["DatasetSpec", "load_callable", "check_map_style"]

_FORMS = "'package.module:name' or 'path/to/file.py:name'"


def load_callable(spec: str) -> Callable[..., Any]:
    """Imports the class or factory a spec names.

    A file spec's directory goes on ``sys.path`` first (as when running the file as a script), so the file may
    import its neighbours.

    Raises:
        SpecError: a malformed spec, a missing file or module, an import error, or a name that is not callable.
    """
    module_part, sep, name = spec.rpartition(":")
    if not sep or not module_part or not name or not name.replace(".", "_").isidentifier():
        raise SpecError(f"dataset spec {spec!r} is malformed; write {_FORMS}, e.g. 'mypkg.data:ImageNet'")
    if module_part.endswith(".py") or os.sep in module_part:
        module = _import_file(module_part, spec)
    else:
        try:
            module = importlib.import_module(module_part)
        except ImportError as exc:
            raise SpecError(f"cannot import module {module_part!r} of dataset spec {spec!r} ({exc}); install it, "
                            "add its directory to PYTHONPATH, or name a file: 'path/to/file.py:name'") from None
        except Exception as exc:
            raise SpecError(f"importing module {module_part!r} of dataset spec {spec!r} raised "
                            f"{type(exc).__name__}: {exc}; fix the module (--debug shows the traceback)") from exc
    target: Any = module
    for part in name.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise SpecError(f"{module_part} has no attribute {name!r} (dataset spec {spec!r}); check the name after "
                            "the colon") from None
    if not callable(target):
        raise SpecError(f"{spec} is a {type(target).__name__}, not a Dataset class or factory function; name "
                        "something that returns a map-style dataset when called")
    return target


def _import_file(path: str, spec: str) -> Any:
    full = os.path.abspath(path)
    if not os.path.isfile(full):
        raise SpecError(f"dataset file {path} of spec {spec!r} does not exist; check the path (relative paths start "
                        "at the current directory)")
    name = os.path.splitext(os.path.basename(full))[0]
    existing = sys.modules.get(name)
    if existing is not None and os.path.abspath(getattr(existing, "__file__", "") or "") == full:
        return existing
    if existing is not None or not name.isidentifier():
        name = f"_mmapcache_spec_{abs(hash(full)):x}"
    directory = os.path.dirname(full)
    if directory not in sys.path:
        sys.path.insert(0, directory)
    module_spec = importlib.util.spec_from_file_location(name, full)
    if module_spec is None or module_spec.loader is None:
        raise SpecError(f"{path} cannot be imported as a Python module (spec {spec!r}); name a .py file")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # registered before running, so classes it defines pickle by name
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise SpecError(f"importing {path} (dataset spec {spec!r}) raised {type(exc).__name__}: {exc}; fix the file "
                        "(--debug shows the traceback)") from exc
    return module


def check_map_style(dataset: Any, spec: str) -> Any:
    """Returns ``dataset`` if it is a non-empty map-style dataset, else raises ``SpecError`` saying why."""
    if not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
        raise SpecError(f"{spec} returned {type(dataset).__name__!r} object, not a map-style dataset (one with "
                        "__len__ and "
                        "__getitem__); iterable datasets cannot be cached: return a map-style dataset")
    try:
        n = len(dataset)
    except Exception as exc:
        raise SpecError(f"len() of the dataset from {spec} raised {type(exc).__name__}: {exc}; fix its "
                        "__len__") from exc
    if n == 0:
        raise SpecError(f"the dataset from {spec} is empty; there is nothing to cache (check its arguments)")
    return dataset


class DatasetSpec:
    """A picklable recipe for a source dataset: a spec string (or a callable) and keyword arguments.

    Calling it imports the spec (once per process) and returns a new dataset. Safe to call in any process.

    Args:
        target: ``package.module:name``, ``path/to/file.py:name``, or a callable returning a dataset.
        kwargs: keyword arguments for the call.
    """

    def __init__(self, target: str | Callable[..., Any], kwargs: dict[str, Any] | None = None) -> None:
        if not isinstance(target, str) and not callable(target):
            raise TypeError(f"the dataset must be a spec string or a callable returning a dataset, got "
                            f"{type(target).__name__}")
        self.target = target
        self.kwargs = dict(kwargs or {})
        if isinstance(target, str):
            load_callable(target)  # fail early, in the caller's process, with a clear message
            # Workers started by spawn/forkserver resolve relative file specs against the same directory.
            module_part, _, name = target.rpartition(":")
            if module_part.endswith(".py") or os.sep in module_part:
                self.target = f"{os.path.abspath(module_part)}:{name}"

    @property
    def name(self) -> str:
        target = self.target
        return target if isinstance(target, str) else getattr(target, "__qualname__", repr(target))

    def __call__(self) -> Any:
        factory = load_callable(self.target) if isinstance(self.target, str) else self.target
        try:
            dataset = factory(**self.kwargs)
        except Exception as exc:
            raise SpecError(f"{self.name}(**{self.kwargs!r}) raised {type(exc).__name__}: {exc}; check --kwargs "
                            "(--debug shows the traceback)") from exc
        return check_map_style(dataset, self.name)
