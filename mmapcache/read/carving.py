"""How a lent batch is pickled in a worker and unpickled in the main process (``read.lending`` says why).

``Carving`` writes each tensor carved from one of the batch's lent storages as its place there: a call,
``_carved(n, dtype, offset, shape, strides, requires_grad, kind)``, where ``n`` numbers the storage among the
batch's, and the tensor's attributes as the state set after it (as pickle sets an object's state), so that pickle's
memo keeps a tensor one object wherever it appears, even as an attribute of another tensor or of itself.
``Uncarving`` resolves ``_carved`` to a function over the storages the main process made for the batch. Everything
else is pickled as the worker's queue would, tensors by file descriptor, except what would alias the worker's pool
without being carved (``Carving.storage``) and what torch's reducer gets wrong (conjugate and negative views, a
subclass's attributes when they hold the subclass).
"""

from __future__ import annotations

import functools
import io
import pickle
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch


class Carving(ForkingPickler):
    """Pickles a worker's batch with each tensor carved from a lent storage written as its place in it (see the
    module docstring); every other object as the worker's queue would (tensors elsewhere by file descriptor).
    Whatever else reaches a storage of the worker's pool (a tensor of an earlier batch sent again, a sparse tensor's
    parts, a ``Parameter``'s own reducer, a bare storage) reaches it as a storage object, and that crosses as a copy
    (``storage``): sent by descriptor, the main process would map it as the pool storage it already maps, with no
    record of this batch, and the worker would fill it again once the batch it was lent for was dropped."""

    def __init__(self, file: io.BytesIO, index: dict[int, int], pool: set[int]) -> None:
        super().__init__(file, pickle.HIGHEST_PROTOCOL)
        self.index = index  # each lent storage's address: its place in the batch's list of them
        self.pool = pool  # the address of each storage of the worker's pool
        self.copies: dict[int, torch.UntypedStorage] = {}  # each pool storage copied, by address (copied once)

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, (torch.UntypedStorage, torch.TypedStorage)):
            return self.storage(obj)
        if not isinstance(obj, torch.Tensor) or obj.layout is not torch.strided or obj.device.type != "cpu":
            return NotImplemented  # (a sparse or nested tensor's parts come back here, as tensors or storages)
        if (obj.is_conj() or obj.is_neg()) and not obj.requires_grad:  # (torch's reducer drops the bit: wrong values)
            return _same, (obj.resolve_conj().resolve_neg(),)
        kind = None if type(obj) is torch.Tensor else type(obj)
        n = self.index.get(obj.untyped_storage().data_ptr())
        if (n is None or obj.is_quantized or obj.is_conj() or obj.is_neg() or (obj.requires_grad and not obj.is_leaf)
                or type(obj).__reduce_ex__ is not torch.Tensor.__reduce_ex__):
            if kind is None or obj.requires_grad or type(obj).__reduce_ex__ is not torch.Tensor.__reduce_ex__:
                return NotImplemented  # (torch's reducer, or the class's own: its storage comes back here)
            # A subclass not carved: its data as a plain tensor, and its attributes as the state set after it, so
            # that one holding itself keeps them (torch's own reducer drops them).
            state = torch._utils._get_obj_state(obj)
            return _as_kind, (obj.as_subclass(torch.Tensor), kind), state or None, None, None, _with_state
        state = torch._utils._get_obj_state(obj)  # (a subclass's attributes)
        place = (n, obj.dtype, obj.storage_offset(), tuple(obj.shape), obj.stride(), obj.requires_grad, kind)
        return _carved, place, state or None, None, None, _with_state

    def storage(self, storage: torch.UntypedStorage | torch.TypedStorage) -> Any:
        """A storage being pickled: a copy of its own if it is one of the pool's (see the class docstring)."""
        untyped = storage._untyped_storage if isinstance(storage, torch.TypedStorage) else storage
        address = untyped.data_ptr()
        if untyped.device.type != "cpu" or address not in self.pool:
            return NotImplemented
        if address not in self.copies:
            self.copies[address] = untyped.clone()
        copy = self.copies[address]
        if isinstance(storage, torch.TypedStorage):
            return _typed, (copy, storage.dtype)
        return _same, (copy,)


def _carved(*place: Any) -> torch.Tensor:  # (named in the pickle; ``Uncarving`` resolves it to its own)
    raise RuntimeError("mmapcache: a lent batch unpickled outside its loader")


def _with_state(t: torch.Tensor, state: Any) -> None:
    """Sets a carved tensor's attributes, as torch does when it unpickles a subclass."""
    if type(t).__setstate__ is not torch.Tensor.__setstate__:
        t.__setstate__(state)
    else:
        torch._utils._set_obj_state(t, state)


class Uncarving(pickle.Unpickler):
    """Unpickles a batch ``Carving`` wrote, its carved tensors made in ``storages`` (one per lent storage)."""

    def __init__(self, payload: bytes, storages: list[torch.UntypedStorage]) -> None:
        super().__init__(io.BytesIO(payload))
        self.storages = storages

    def find_class(self, module: str, name: str) -> Any:
        if module == __name__ and name == "_carved":  # (not a bound method: the memo holding it would make a cycle
            return functools.partial(_carve, self.storages)  # that keeps the batch's storages until a collection)
        return super().find_class(module, name)


def _carve(storages: list[torch.UntypedStorage], n: int, dtype: torch.dtype, offset: int, shape: tuple[int, ...],
           stride: tuple[int, ...], grad: bool, kind: type[torch.Tensor] | None) -> torch.Tensor:
    t = torch.empty(0, dtype=dtype).set_(storages[n], offset, shape, stride)
    if grad:
        t.requires_grad_()
    return t if kind is None else t.as_subclass(kind)


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _as_kind(t: torch.Tensor, kind: type[torch.Tensor]) -> torch.Tensor:
    return t.as_subclass(kind)


def _typed(storage: torch.UntypedStorage, dtype: torch.dtype) -> torch.TypedStorage:
    return torch.TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True)
