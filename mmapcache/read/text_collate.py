"""``TextCollate``: token batches a model takes as they come, padded or padding-free, copied straight from the heaps.

``model(**batch)`` and Hugging Face's ``Trainer`` take a dict of plain tensors: ``input_ids`` padded with the
tokenizer's pad id, an ``attention_mask`` of ones on the real tokens, ``labels`` padded with -100. ``TextCollate``
makes that from samples that are dicts of fields: each ragged 1-D field it pads (``fields``, default every one) is
padded with its own value (``pad``), the attention mask is built once from the first padded field's lengths (a
field of that name in the samples is not read: pass ``attention_mask=None`` to pad it as stored), ``labels`` may be
made from a field (padded with ``ignore_index``), and every other field is collated as ``default_collate`` collates
it. With ``flatten=True`` the batch is padding-free, as Hugging Face's ``DataCollatorWithFlattening`` makes it for
flash-attention's variable-length kernels: one row of every token (``input_ids`` ``(1, T)``), ``position_ids``
restarting at 0 with each sample, ``labels`` with ``ignore_index`` at each sample's first token, and the samples'
boundaries ``cu_seq_lens_q``/``cu_seq_lens_k`` (int32, ``B + 1``) and ``max_length_q``/``max_length_k``.

Over any dataset it works as a ``collate_fn`` (from the samples). Given to ``ds.loader()`` (or a mixture's), a
warm batch is copied straight from the caches' heaps into the padded (or flat) tensors, one copy per token
(``read_parts``, ``read.heap_batch``); values stored narrower than the source gave them (``store_as``) are widened
by that copy. What it pads or flattens comes back in the source's dtype.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch
from torch.utils.data import default_collate

from .heap_batch import Located, WarmRows, bits_of, flat_tensor, mask_of, padded_tensor

__all__ = ["TextCollate"]



class TextCollate:
    """A ``collate_fn`` for token batches (see the module docstring).

    Args:
        pad: the pad value of every padded field, or per field (``{"input_ids": 0, "labels": -100}``; a field not
            named is padded with 0).
        attention_mask: the key of the mask built from the first padded field's lengths (1 on tokens, 0 on
            padding), or None for no mask (a stored mask is then padded as any field). Not made when flattened.
        mask_dtype: its dtype (``torch.int64``, as tokenizers return it).
        labels: a padded field (``"input_ids"``) whose values are also returned as ``labels``, padded (or, when
            flattened, each sample's first token masked) with ``ignore_index``: a causal language model's labels.
        ignore_index: see ``labels`` (-100: what PyTorch's cross entropy and Hugging Face's models ignore).
        flatten: padding-free batches (see the module docstring).
        pad_to_multiple_of: round the padded length up to a multiple of this (tensor cores like multiples of 8).
        fields: the fields to pad or flatten (default: every 1-D tensor, array or list of numbers of varying
            length: a cache's ragged fields).
    """

    def __init__(self, pad: int | Mapping[str, int] = 0, *, attention_mask: str | None = "attention_mask",
                 mask_dtype: torch.dtype = torch.int64, labels: str | None = None, ignore_index: int = -100,
                 flatten: bool = False, pad_to_multiple_of: int | None = None,
                 fields: Iterable[str] | None = None) -> None:
        if isinstance(pad, Mapping):
            if not all(isinstance(k, str) and _is_int(v) for k, v in pad.items()):
                raise TypeError(f"pad must be an int or a dict of field name -> int, got {dict(pad)!r}")
            self.pads = {k: int(v) for k, v in pad.items()}
            self.default_pad = 0
        elif _is_int(pad):
            self.pads, self.default_pad = {}, int(pad)
        else:
            raise TypeError(f"pad must be an int or a dict of field name -> int, got {pad!r}")
        if attention_mask is not None and not isinstance(attention_mask, str):
            raise TypeError(f"attention_mask must be a key (str) or None, got {attention_mask!r}")
        if labels is not None and not isinstance(labels, str):
            raise TypeError(f"labels must be the name of a padded field (str) or None, got {labels!r}")
        if not _is_int(ignore_index):
            raise TypeError(f"ignore_index must be an int, got {ignore_index!r}")
        if pad_to_multiple_of is not None and (not _is_int(pad_to_multiple_of) or pad_to_multiple_of < 1):
            raise ValueError(f"pad_to_multiple_of must be an int >= 1, got {pad_to_multiple_of!r}")
        if isinstance(fields, str):
            raise TypeError(f"fields must be a list of field names, got the str {fields!r}; write fields=[{fields!r}]")
        self.attention_mask, self.mask_dtype = attention_mask, mask_dtype
        self.labels, self.ignore_index = labels, int(ignore_index)
        self.flatten, self.multiple = bool(flatten), pad_to_multiple_of
        self.fields = None if fields is None else list(fields)

    def pad_of(self, name: str) -> int:
        return self.pads.get(name, self.default_pad)

    def check_fields(self, paths: set[str]) -> None:
        """A ValueError if ``fields``, ``pad`` or ``labels`` names a field the samples do not have (a typo would
        silently not pad)."""
        named = set(self.fields or []) | set(self.pads) | ({self.labels} if self.labels else set())
        if not named <= paths:
            raise ValueError(f"TextCollate names {sorted(named - paths)}, which the samples do not have; their "
                             f"fields are {sorted(paths)}")

    # --- over any samples -----------------------------------------------------------------------------------------

    def __call__(self, samples: list[Any]) -> dict[str, Any]:
        if not samples or not all(isinstance(s, Mapping) for s in samples):
            raise TypeError("TextCollate takes samples that are dicts of fields (as model(**batch) takes them), "
                            f"got {type(samples[0]).__name__ if samples else 'an empty batch'}")
        names = list(samples[0])
        padded = self._padded_names(names, lambda n: _varies([s[n] for s in samples]))
        values: dict[str, tuple[Located, torch.dtype]] = {}
        for name in padded:
            arrays = [_as_numpy(s[name]) for s in samples]
            if any(a.ndim != 1 for a in arrays):
                raise ValueError(f"TextCollate pads 1-D values; field {name!r} holds values of shape "
                                 f"{next(a.shape for a in arrays if a.ndim != 1)}")
            lengths = np.array([len(a) for a in arrays], np.int64)
            flat = np.concatenate(arrays) if arrays else np.empty(0, np.int64)
            values[name] = (_located(flat, lengths), _torch_dtype(samples[0][name], flat))
        rest = {n: default_collate([s[n] for s in samples]) for n in names if n not in values and not (
            n == self.attention_mask and padded)}
        return self._assemble(names, values, rest)

    def _padded_names(self, names: list[str], varies: Any) -> list[str]:
        """The fields to pad or flatten, checked: the ``fields`` given, or every varying one."""
        if self.fields is not None:
            missing = [f for f in self.fields if f not in names]
            if missing:
                raise ValueError(f"TextCollate(fields=...) names {missing}, which the samples do not have; their "
                                 f"fields are {names}")
            padded = list(self.fields)
        else:
            padded = [n for n in names if n != self.attention_mask and varies(n)]
        if self.labels is not None and self.labels not in padded:
            raise ValueError(f"TextCollate(labels={self.labels!r}) must name a padded field, one of {padded}")
        return padded

    # --- the batch ----------------------------------------------------------------------------------------------

    def _assemble(self, names: list[str], values: dict[str, tuple[Located, torch.dtype]],
                  rest: dict[str, Any]) -> dict[str, Any]:
        """The batch from each padded field's values (``Located``: in the samples' arrays or in a cache's heaps,
        copied once here, never handed out) and its torch dtype, and the other fields collated."""
        if self.flatten:
            return self._flat(names, values, rest)
        out: dict[str, Any] = {}
        first = next(iter(values.values()), None)
        width = max((int(v.lengths.max()) if len(v.lengths) else 0 for v, _ in values.values()), default=0)
        if self.multiple:
            width = -(-width // self.multiple) * self.multiple
        for name in names:
            if name in values:
                located, dtype = values[name]
                out[name] = _padded(located, self.pad_of(name), dtype, width)
            elif name in rest:
                out[name] = rest[name]
        if first is not None and self.attention_mask is not None:
            out[self.attention_mask] = mask_of(first[0].lengths, width, self.mask_dtype)
        if self.labels is not None:
            located, dtype = values[self.labels]
            out["labels"] = _padded(located, self.ignore_index, dtype, width)
        return out

    def _flat(self, names: list[str], values: dict[str, tuple[Located, torch.dtype]],
              rest: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        lengths = next(iter(values.values()))[0].lengths if values else np.zeros(0, np.int64)
        for name in names:
            if name in values:
                located, dtype = values[name]
                if not np.array_equal(located.lengths, lengths):
                    raise ValueError(f"TextCollate(flatten=True): field {name!r}'s values are not as long as the "
                                     f"first flattened field's: one row of tokens needs fields of equal lengths")
                out[name] = flat_tensor(located, dtype)[None, :]
            elif name in rest:
                out[name] = rest[name]
        cu = np.zeros(len(lengths) + 1, np.int32)
        np.cumsum(lengths, out=cu[1:])
        starts = cu[:-1].astype(np.int64)
        out["position_ids"] = torch.from_numpy(_positions(lengths, int(cu[-1])))[None]
        if self.labels is not None:
            labels = out[self.labels].clone()
            first = starts[lengths > 0]
            labels[0, torch.from_numpy(first)] = self.ignore_index  # no sample's first token predicts across
            out["labels"] = labels
        longest = int(lengths.max()) if len(lengths) else 0
        cu_tensor = torch.from_numpy(cu)
        out.update(cu_seq_lens_q=cu_tensor, cu_seq_lens_k=cu_tensor, max_length_q=longest, max_length_k=longest)
        return out

    # --- straight from caches' maps -------------------------------------------------------------------------------

    def read_parts(self, parts: list[tuple[Any, np.ndarray]]) -> dict[str, Any] | None:
        """The batch of the cache rows of ``parts`` (``(RowReader, rows)``: one cache's, or a mixture's sources' in
        turn), copied straight from their maps (``read.heap_batch``), if every row is complete and no writer changed
        a cache meanwhile; None otherwise (the caller gathers with the checks and calls ``from_columns``)."""
        warm = WarmRows(parts)
        if not warm.begin():
            return None
        fields = warm.fields
        names = [f.name for f in fields if f.kind != "json"]
        number = {f.name: k for k, f in enumerate(fields)}
        padded = self._padded_names(names, lambda n: warm.paddable(number[n]))
        values: dict[str, tuple[Located, torch.dtype]] = {}
        for name in padded:
            located = warm.located(number[name]) if warm.paddable(number[name]) else None
            if located is None:
                return None  # (a fixed field asked to be padded, or damage: the checked path pads or reports it)
            values[name] = (located, _target(fields[number[name]]))
        rest: dict[str, Any] = {}
        for k, field in enumerate(fields):
            if field.name in values or field.kind == "json" or (field.name == self.attention_mask and padded):
                continue
            value = warm.other(k)
            if value is None:
                return None
            rest[field.name] = value
        batch = self._assemble(names, values, rest)
        return batch if warm.unchanged() else None

    def from_columns(self, reader: Any, columns: list[Any]) -> dict[str, Any]:
        """The batch from a checked gather's columns (``RowReader.gather``: fixed arrays, ``RaggedColumn``s)."""
        fields = reader.fields
        names = [f.name for f in fields if f.kind != "json"]
        ragged = {f.name: k for k, f in enumerate(fields) if f.ragged and len(f.shape) == 1 and f.kind not in (
            "str", "bytes", "numpy_str", "numpy_bytes", "json")}
        padded = self._padded_names(names, lambda n: n in ragged)
        values: dict[str, tuple[Located, torch.dtype]] = {}
        for name in padded:
            k = names.index(name)
            column = columns[k]
            if name in ragged:
                flat, counts, _ = column.merged()
            else:  # a fixed 1-D field asked for: its values are of one length
                array = np.asarray(column)
                flat = array.reshape(-1)
                counts = np.full(len(array), array.shape[1] if array.ndim > 1 else 1, np.int64)
            values[name] = (_located(flat, counts), _target(fields[k]))
        rest = {}
        for k, field in enumerate(fields):
            if field.name in values or field.kind == "json" or (field.name == self.attention_mask and padded):
                continue
            if field.ragged:
                rest[field.name] = reader._splitters[k](columns[k])
            else:
                rest[field.name] = reader._batch_converters[k](columns[k])
        return self._assemble(names, values, rest)


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))



def _varies(values: list[Any]) -> bool:
    """Whether a field's values are 1-D sequences (tensors, arrays, lists of numbers) whose lengths differ."""
    first = values[0]
    if not isinstance(first, (torch.Tensor, np.ndarray, list)):
        return False
    try:
        return len({len(v) for v in values}) > 1 and all(np.ndim(v) == 1 for v in values)
    except TypeError:
        return False



def _as_numpy(value: Any) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        bits = bits_of(value.dtype)  # (bfloat16 values: as their bits, which the batch is filled with)
        return (value if bits is None else value.view(bits)).detach().numpy()
    return np.asarray(value)



def _torch_dtype(value: Any, flat: np.ndarray) -> torch.dtype:
    if isinstance(value, torch.Tensor):
        return value.dtype
    return torch.from_numpy(np.zeros(0, flat.dtype)).dtype



def _target(field: Any) -> torch.dtype:
    """The torch dtype a field's values are served as (the source's, also where they are stored narrower)."""
    if field.torch_dtype is not None:
        return getattr(torch, field.torch_dtype)
    return torch.from_numpy(np.zeros(0, field.np_dtype)).dtype



def _positions(lengths: np.ndarray, total: int) -> np.ndarray:
    """Each token's position in its sample, ``0 .. length - 1`` sample after sample: ones summed, each sample's first
    step set to go back to 0 (one pass over the tokens, no index arrays as long as them)."""
    steps = np.ones(total, np.int64)
    kept = lengths[lengths > 0]
    if len(kept):
        steps[0] = 0
        steps[np.cumsum(kept)[:-1]] = 1 - kept[:-1]
    return np.cumsum(steps, out=steps)


def _located(flat: np.ndarray, lengths: np.ndarray) -> Located:
    """Values given back to back, as ``Located``."""
    return Located([(flat, np.cumsum(lengths) - lengths, lengths)], lengths)


def _padded(located: Located, pad: int, dtype: torch.dtype, width: int) -> torch.Tensor:
    return padded_tensor(located, pad, dtype, width)
