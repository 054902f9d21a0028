"""``TextCollate``: token batches a model takes as they come, padded or padding-free, copied straight from the heaps.

``model(**batch)`` and Hugging Face's ``Trainer`` take a dict of plain tensors: ``input_ids`` padded with the
tokenizer's pad id, an ``attention_mask`` of ones on the real tokens, ``labels`` padded with -100. ``TextCollate``
makes that from samples that are dicts of fields:

- every 1-D field of numbers (a tensor, array or list of numbers, whatever its length: ``fields`` chooses others)
  among the samples' own keys (one under a nested key is collated under it, below, from a cache too) is padded to
  its own longest value in the batch (rounded up to ``pad_to_multiple_of``), with its own pad value (``pad``; a
  ``labels`` field with ``ignore_index``, ``token_type_ids`` with 0 and ``special_tokens_mask`` with 1, as a
  tokenizer pads them, unless ``pad`` names them);
- the attention mask is the samples' own (``attention_mask``, padded with 0: a tokenizer's mask that already holds
  zeros keeps them), or, where the samples have none (or ``build_mask``), built from the lengths of ``mask_from``
  (default ``input_ids``): 1 on the tokens, 0 on the padding;
- ``labels="input_ids"`` also returns that field as ``labels``, padded with ``ignore_index`` (a causal language
  model's labels; masked by length and by the samples' own mask, where a tokenizer padded them, not by token id: an
  EOS that is also the pad token stays a label). Labels of integers are int64, as Hugging Face's collators return
  them (losses take int64, and -100 fits no unsigned type), whatever dtype the ids have; so is a padded field of
  labels;
- every other field is collated as ``default_collate`` collates it (``str`` fields: lists), but a 1-D list of
  numbers it does not pad stays each sample's list, as a cache gives it back (``default_collate`` would transpose
  it); a field of labels
  (``label`` or ``label_ids``: a class, a multi-hot vector, token labels padded with ``ignore_index``) comes back as
  ``labels``, as Hugging Face's collators return it (a model given ``label`` ignores it and returns no loss), unless
  the batch has ``labels`` already (padded batches: a flattened one's ``labels`` are tokens);
- ``columns`` keeps only the fields named, besides the mask (``attention_mask``/``build_mask`` decide that one): the
  fields a model takes (a transformers model takes ``**kwargs`` and ignores what it does not know, so a field left
  in is no error, only work for nothing). A warm batch never reads the others, so neither copies nor decodes them
  (a cold one gathers every field).

Samples are dicts of fields: a field that is itself a dict (or a tuple) comes back under its key, as
``default_collate`` collates it, over samples and from a cache alike (where its values are fields of their own,
``"meta.source"``, regrouped under ``"meta"``); ``columns`` names it by its key (or its fields by their paths).

With ``flatten=True`` the batch is padding-free, as Hugging Face's ``DataCollatorWithFlattening`` makes it for
flash-attention's variable-length kernels: one row of every token of each padded field (``input_ids`` ``(1, T)``),
``position_ids`` restarting at 0 with each sample, ``labels`` with ``ignore_index`` at each sample's first token, the
non-empty samples' boundaries ``cu_seq_lens_q``/``cu_seq_lens_k`` (int32) and ``max_length_q``/``max_length_k``;
no attention mask (the boundaries are the mask; the samples' own is dropped, also with ``attention_mask=None``), and
``use_cache=False``: flash-attention's kernels read the boundaries, but with any other attention (``sdpa``,
``eager``: every CPU) a Hugging Face model builds the per-sample mask from ``position_ids`` only when it keeps no
cache, and otherwise lets each sample attend to the ones before it in the row, silently (transformers 5:
``masking_utils``). ``model(**batch)`` thereby passes it. Flatten samples as a tokenizer gives them unpadded
(``padding=False``): a sample's own padding would be tokens of the row.

Over any dataset it works as a ``collate_fn`` (from the samples), every batch with the same keys. Given to
``ds.loader()`` (or a mixture's), a warm batch is copied straight from the caches' heaps into the padded (or flat)
tensors, one copy per token (``read_parts``, ``read.heap_batch``); values stored narrower than the source gave them
(``store_as``) are widened by that copy. What it pads or flattens comes back in the source's dtype (labels:
int64); over samples whose values of one field differ in dtype (a ``ConcatDataset`` of int32 and int64 ids), in the
one ``torch.cat`` promotes them to, every value exact (``pad_sequence`` would wrap them into the first one's).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch
from torch.utils.data import default_collate

from . import arena
from .collate import torch_of, typed_alike
from .heap_batch import Located, WarmRows, flat_tensor, mask_of, padded_tensor, positions
from .lengths import TOKEN_FIELDS
from .nested import nested, nested_fields

__all__ = ["TextCollate"]

_LABELS = "labels"
_CLASS_LABELS = ("label", "label_ids")  # what Hugging Face's collators return as labels
# Fields a Hugging Face tokenizer returns besides ids and mask, padded as its ``pad()`` pads them (not with the pad
# id: a RoBERTa's pad id 1 is no token type of its one).
_TOKENIZER_PADS = {"token_type_ids": 0, "special_tokens_mask": 1}


class TextCollate:
    """A ``collate_fn`` for token batches (see the module docstring).

    Args:
        pad: the pad value of every padded field, a tokenizer (its ``pad_token_id``, as Hugging Face's collators
            take one; it must pad on the right), or per field (``{"input_ids": tokenizer.pad_token_id}``; a field
            not named is padded with 0, a ``labels`` field with ``ignore_index``; ``token_type_ids`` and
            ``special_tokens_mask`` as a tokenizer pads them, with 0 and 1, unless named here).
        attention_mask: the mask's key: the samples' field of that name, padded with 0, or (where they have none)
            the mask built from ``mask_from``'s lengths; None for no mask (a field of that name is then padded as
            any other). Not returned when flattened.
        mask_dtype: a built mask's dtype (``torch.int64``, as tokenizers return it).
        mask_from: the field whose lengths make a built mask (default ``input_ids`` where padded, else the first
            padded field).
        build_mask: build the mask even where the samples have one (an all-ones stored mask need not be read).
        labels: a padded field (``"input_ids"``) whose values are also returned as ``labels``, padded (or, when
            flattened, each sample's first token masked) with ``ignore_index``. Refused where the samples have a
            ``labels`` field of their own.
        ignore_index: see ``labels`` (-100: what PyTorch's cross entropy and Hugging Face's models ignore).
        flatten: padding-free batches (see the module docstring).
        pad_to_multiple_of: round each padded length up to a multiple of this (tensor cores like multiples of 8).
        fields: the fields to pad or flatten (default: every 1-D field of numbers).
        columns: the samples' fields the batch holds (default: all), as Hugging Face's ``select_columns``; the others
            are not read by a warm batch. The mask is not chosen here: the samples' own is kept (it may hold zeros, a
            tokenizer's padding, which a mask built from the lengths would attend to), unless ``build_mask`` or
            ``attention_mask=None``. What the collate makes is added: a built mask, ``labels``, a flattened batch's
            positions and boundaries.
        rename_labels: return a ``label`` or ``label_ids`` field as ``labels`` in a padded batch that has no
            ``labels`` (see the module docstring); False keeps its name.
        position_ids_start: a flattened batch's first position of each sample (0; 2 for RoBERTa-like models, whose
            positions start past their padding index), as Hugging Face's ``DataCollatorWithFlattening`` takes it.
    """

    def __init__(self, pad: int | Mapping[str, int] = 0, *, attention_mask: str | None = "attention_mask",
                 mask_dtype: torch.dtype = torch.int64, mask_from: str | None = None, build_mask: bool = False,
                 labels: str | None = None, ignore_index: int = -100, flatten: bool = False,
                 pad_to_multiple_of: int | None = None, fields: Iterable[str] | None = None,
                 columns: Iterable[str] | None = None, rename_labels: bool = True,
                 position_ids_start: int = 0) -> None:
        pad = _pad_of_tokenizer(pad)
        if isinstance(pad, Mapping):
            if not all(isinstance(k, str) and _is_int(v) for k, v in pad.items()):
                raise TypeError(f"pad must be an int or a dict of field name -> int, got {dict(pad)!r}")
            self.pads = {k: int(v) for k, v in pad.items()}
            self.default_pad = 0
        elif _is_int(pad):
            self.pads, self.default_pad = {}, int(pad)
        else:
            raise TypeError(f"pad must be an int, a dict of field name -> int or a tokenizer, got "
                            f"{type(pad).__name__}")
        for name, value in (("attention_mask", attention_mask), ("mask_from", mask_from), ("labels", labels)):
            if value is not None and not isinstance(value, str):
                raise TypeError(f"{name} must be a field name (str) or None, got {value!r}")
        if not _is_int(ignore_index):
            raise TypeError(f"ignore_index must be an int, got {ignore_index!r}")
        if not _is_int(position_ids_start) or position_ids_start < 0:
            raise ValueError(f"position_ids_start must be an int >= 0, got {position_ids_start!r}")
        if position_ids_start and not flatten:
            raise ValueError("position_ids_start is where a flattened batch's positions start; a padded batch has "
                             "none (the model numbers its rows): pass flatten=True, or leave it out")
        if pad_to_multiple_of is not None and (not _is_int(pad_to_multiple_of) or pad_to_multiple_of < 1):
            raise ValueError(f"pad_to_multiple_of must be an int >= 1, got {pad_to_multiple_of!r}")
        if pad_to_multiple_of is not None and flatten:
            raise ValueError("pad_to_multiple_of rounds up padded rows; a flattened batch has no padding (one row of "
                             "every token): pass one or the other")
        for name, names in (("fields", fields), ("columns", columns)):
            if isinstance(names, str):
                raise TypeError(f"{name} must be a list of field names, got the str {names!r}; write "
                                f"{name}=[{names!r}]")
        # A flattened batch has no mask: the samples' own is dropped even with attention_mask=None (flattened as a
        # field, a (1, T) mask of ones makes a model attend across the samples).
        self.attention_mask = "attention_mask" if flatten and attention_mask is None else attention_mask
        self.mask_dtype = mask_dtype
        self.mask_from, self.build_mask = mask_from, bool(build_mask)
        self.labels, self.ignore_index = labels, int(ignore_index)
        self.flatten, self.multiple = bool(flatten), pad_to_multiple_of
        self.fields = None if fields is None else list(fields)
        self.columns = None if columns is None else frozenset(columns)
        self.rename_labels = bool(rename_labels)
        self.position_ids_start = int(position_ids_start)
        self._kept_plans: dict[int, tuple[list[Any], Any]] = {}  # (see ``_warm_plan``)

    def pad_of(self, name: str) -> int:
        """The value ``name`` is padded with, unless ``pad`` names it: the samples' attention mask with 0 (never the
        pad id: a mask padded with a token id would attend to the padding), a field of labels (``labels``,
        ``label``, ``label_ids``: token labels) with ``ignore_index`` (0 is a class), ``token_type_ids`` with 0 and
        ``special_tokens_mask`` with 1 (as a Hugging Face tokenizer's ``pad()``), any other with ``pad``."""
        if name in self.pads:
            return self.pads[name]
        if name == self.attention_mask:
            return 0
        if name in _TOKENIZER_PADS:
            return _TOKENIZER_PADS[name]
        return self.ignore_index if name == _LABELS or name in _CLASS_LABELS else self.default_pad

    def _kept(self, names: Any) -> Any:
        """``names`` (the samples' fields, in their order) less those ``columns`` leaves out (not the mask)."""
        if self.columns is None:
            return names
        kept = [name for name in names if _chosen(name, self.columns) or name == self.attention_mask or any(
            c.startswith(name + ".") for c in self.columns)]  # (over samples: a key some of whose fields are named)
        return set(kept) if isinstance(names, (set, frozenset)) else kept

    def check_fields(self, paths: set[str]) -> None:
        """A ValueError if ``columns``, ``fields``, ``pad``, ``mask_from`` or ``labels`` names a field the samples do
        not have (a typo would silently not pad), one of the last four a field ``columns`` leaves out, or ``labels=``
        would replace the samples' own ``labels``."""
        named = set(self.fields or []) | set(self.pads) | ({self.labels} if self.labels else set()) | (
            {self.mask_from} if self.mask_from else set())
        paths = set(paths) | {path[:at] for path in paths for at in range(len(path)) if path[at] == "."}  # (their keys)
        if not (named | (self.columns or set())) <= paths:
            raise ValueError(f"TextCollate names {sorted((named | (self.columns or set())) - paths)}, which the "
                             f"samples do not have; their fields are {sorted(paths)}")
        if self.columns is not None and not named <= self.columns:
            raise ValueError(f"TextCollate names {sorted(named - self.columns)} to pad or copy, which its "
                             f"columns={sorted(self.columns)} leave out: add them to columns")
        if self.labels is not None and _LABELS in paths:  # (columns= leaving them out too: found by review)
            keep = f" (and name {_LABELS!r} in columns=)" if self.columns is not None else ""
            raise ValueError(f"TextCollate(labels={self.labels!r}) would replace the samples' own {_LABELS!r} field "
                             f"(prompt tokens masked with -100, say): leave labels= out{keep}, and their {_LABELS!r} "
                             f"are padded with ignore_index ({self.ignore_index})")

    # --- over any samples -----------------------------------------------------------------------------------------

    def __call__(self, samples: list[Any]) -> dict[str, Any]:
        if not samples or not all(isinstance(s, Mapping) for s in samples):
            raise TypeError("TextCollate takes samples that are dicts of fields (as model(**batch) takes them), "
                            f"got {type(samples[0]).__name__ if samples else 'an empty batch'}")
        names = list(samples[0])
        paths = _paths(samples[0])
        self.check_fields(paths)
        inner = frozenset(paths - set(names))
        names = self._kept(names)
        if self.columns is not None:  # a nested key of which columns names some fields: only those (as from a cache)
            samples = [{n: s[n] if _chosen(n, self.columns) else _pruned(s[n], n, self.columns) for n in names}
                       for s in samples]
        padded = self._padded_names(names, lambda n: _sequences([s[n] for s in samples]), inner)
        values: dict[str, tuple[Located, torch.dtype]] = {}
        for name in padded:
            column = [s[name] for s in samples]
            arrays, dtype = _arrays(column)
            if any(a.ndim != 1 for a in arrays):
                raise ValueError(f"TextCollate pads 1-D values; field {name!r} holds values of shape "
                                 f"{next(a.shape for a in arrays if a.ndim != 1)}")
            lengths = np.array([len(a) for a in arrays], np.int64)
            flat = np.concatenate(arrays) if arrays else np.empty(0, np.int64)
            values[name] = (_located(flat, lengths), dtype)
        dropped = self.attention_mask if self._builds(names) or self.flatten else None
        collated = [name for name in names if name not in values and name != dropped]
        for name in collated:
            _refuse_rows_of_one([s[name] for s in samples], name)
        if self.flatten and not values:
            raise _nothing_to_flatten(names)
        rest = {n: _collated([s[n] for s in samples]) for n in collated}
        return self._assemble(names, values, rest)

    def _builds(self, names: list[str]) -> bool:
        """Whether the mask is built (the samples have none of that name, or ``build_mask``), not padded as stored."""
        return self.attention_mask is not None and (self.build_mask or self.attention_mask not in names)

    def _padded_names(self, names: list[str], sequence: Any, inner: frozenset[str] = frozenset()) -> list[str]:
        """The fields to pad or flatten, checked: the ``fields`` given, or every 1-D field of numbers (a mask
        that is built is not read; a flattened batch has none). Only the samples' own keys: a cache's fields under
        a nested key (``inner``, ``"meta.span"``) are collated under it as ``default_collate`` collates them over the
        samples, never padded (nor counted as the tokens a built mask is made from)."""
        under = sorted({n for n in (*self.pads, self.labels, self.mask_from) if n is not None and n in inner})
        if under:
            raise ValueError(f"TextCollate names {under} (pad, labels or mask_from), which lie under a key of the "
                             f"samples: it pads the samples' own keys, {[n for n in names if n not in inner]}, and "
                             "collates a field under a key as default_collate does")
        if self.fields is not None:
            missing = [f for f in self.fields if f not in names or f in inner]
            if missing:
                raise ValueError(f"TextCollate(fields=...) names {missing}, which the samples do not have as keys "
                                 f"of their own; their keys are {[n for n in names if n not in inner]}")
            padded = list(self.fields)
            mask = self.attention_mask
            if mask in names and mask not in padded and not self._builds(names) and not self.flatten and sequence(mask):
                padded.append(mask)  # (the samples' mask is the batch's, padded, whatever fields pads besides)
        else:
            padded = [n for n in names if sequence(n)]
        if self.attention_mask in padded and (self._builds(names) or self.flatten):
            padded.remove(self.attention_mask)
        if self.labels is not None and self.labels not in padded:
            raise ValueError(f"TextCollate(labels={self.labels!r}) must name a padded field, one of {padded} (a "
                             "field of numbers of one length in every sample is padded too; fields=[...] names "
                             "others; only 1-D values are: a tokenizer's return_tensors='pt' gives (1, n), "
                             "squeeze(0) them)")
        source = self.mask_from
        if self._builds(names) and not self.flatten and padded and source is not None and source not in padded:
            raise ValueError(f"TextCollate(mask_from={source!r}) must name a padded field, one of {padded}")
        return padded

    def _mask_source(self, values: dict[str, Any]) -> str | None:
        """The padded field whose lengths make the built mask or a flattened batch's boundaries."""
        if self.mask_from is not None:
            return self.mask_from
        return "input_ids" if "input_ids" in values else next(iter(values), None)

    # --- the batch ----------------------------------------------------------------------------------------------

    def _assemble(self, names: list[str], values: dict[str, tuple[Located, torch.dtype]],
                  rest: dict[str, Any]) -> dict[str, Any]:
        """The batch from each padded field's values (``Located``: in the samples' arrays or in a cache's heaps,
        copied once here, never handed out) and its torch dtype, and the other fields collated."""
        for name, value in rest.items():  # (from a cache: a ragged field of more dimensions comes as a list)
            if isinstance(value, list):
                _refuse_rows_of_one(value, name)
        if self.flatten:
            return self._flat(names, values, rest)
        out: dict[str, Any] = {}
        widths = {name: self._width(located.lengths) for name, (located, _) in values.items()}
        source = self._mask_source(values)
        builds = self._builds(names) and self.attention_mask is not None
        if arena.active():  # (a worker's batch: its padded tensors in one shared storage)
            rows = {name: len(located.lengths) * widths[name] for name, (located, _) in values.items()}
            sizes = [rows[name] * self._served(name, dtype).itemsize for name, (_, dtype) in values.items()
                     if name in names]
            if builds and source is not None:
                sizes.append(rows[source] * self.mask_dtype.itemsize)
            if self.labels is not None:
                sizes.append(rows[self.labels] * _label_dtype(values[self.labels][1]).itemsize)
            arena.reserve(sum(sizes), len(sizes))
        for name in names:
            if name in values:
                located, dtype = values[name]
                out[name] = _padded(located, self.pad_of(name), self._served(name, dtype), widths[name])
            elif name in rest:
                out[name] = rest[name]
        if builds and source is not None and self.attention_mask is not None:
            out[self.attention_mask] = mask_of(values[source][0].lengths, widths[source], self.mask_dtype)
        if self.labels is not None:
            located, dtype = values[self.labels]
            out[_LABELS] = _padded(located, self.ignore_index, _label_dtype(dtype), widths[self.labels])
            self._unlabel_padding(out, names, values)
        return self._renamed(out)

    def _unlabel_padding(self, out: dict[str, Any], names: list[str], values: dict[str, Any]) -> None:
        """``labels`` made from a field: ``ignore_index`` also where the samples' own mask is 0 (samples a tokenizer
        padded: its pad tokens are no targets, as Hugging Face's language-modelling collator ignores them)."""
        mask = self.attention_mask
        if mask is None or mask not in values or self._builds(names) or mask not in out:
            return
        held = out[mask]
        if held.shape != out[_LABELS].shape or int(torch.count_nonzero(held)) == int(values[mask][0].lengths.sum()):
            return  # (every token of every sample is attended: nothing to mask)
        out[_LABELS].masked_fill_(held == 0, self.ignore_index)

    def _renamed(self, out: dict[str, Any]) -> dict[str, Any]:
        """``out`` with its labels (``label``, else ``label_ids``: a class, a multi-hot vector, or token labels
        padded with ``ignore_index``) as ``labels``, in its place, where ``rename_labels`` and ``out`` has no
        ``labels``."""
        if not self.rename_labels or _LABELS in out:
            return out
        key = next((k for k in _CLASS_LABELS if k in out), None)
        if key is None:
            return out
        return {(_LABELS if k == key else k): v for k, v in out.items()}

    def _served(self, name: str, dtype: torch.dtype) -> torch.dtype:
        """The dtype a padded field comes back in: its own, but int64 for integer labels padded with
        ``ignore_index`` (a field of labels: -100 does not fit an unsigned type, and losses take int64)."""
        labels = (name == _LABELS or name in _CLASS_LABELS) and name not in self.pads
        return _label_dtype(dtype) if labels else dtype

    def _width(self, lengths: np.ndarray) -> int:
        width = int(lengths.max()) if len(lengths) else 0
        return -(-width // self.multiple) * self.multiple if self.multiple else width

    def _flat(self, names: list[str], values: dict[str, tuple[Located, torch.dtype]],
              rest: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        source = self._mask_source(values)
        if source is None:
            raise _nothing_to_flatten(names)
        lengths = values[source][0].lengths
        made = self.labels if self.labels is not None else _LABELS if _LABELS in values else None
        if arena.active():  # (a worker's batch: its tensors in one shared storage)
            sizes = [dtype.itemsize for name, (_, dtype) in values.items() if name in names] + [8]  # (positions)
            if made is not None:
                sizes.append(_label_dtype(values[made][1]).itemsize)
            arena.reserve(int(lengths.sum()) * sum(sizes), len(sizes))
        for name in names:
            if name in values:
                located, dtype = values[name]
                if located.lengths is not lengths and not np.array_equal(located.lengths, lengths):
                    raise ValueError(f"TextCollate(flatten=True): field {name!r}'s values are not as long as "
                                     f"{source!r}'s: one row of tokens needs fields of equal lengths (pass "
                                     f"fields=[...] to flatten those that are)")
                out[name] = flat_tensor(located, dtype)[None, :]
            elif name in rest and name != self.attention_mask:
                out[name] = rest[name]
        ends = np.cumsum(lengths)
        cu = np.zeros(len(lengths) + 1, np.int32)
        cu[1:] = ends
        if len(lengths) and not lengths.all():  # (as Hugging Face's: an empty sample is no sequence of the row)
            cu = np.concatenate([cu[:1], cu[1:][lengths > 0]])
        out["position_ids"] = positions(lengths)[None]
        if self.position_ids_start:
            out["position_ids"] += self.position_ids_start
        if made is not None:  # no sample's first token predicts across the one before it
            tokens = out[made]
            labels = arena.like(tokens, _label_dtype(tokens.dtype)).copy_(tokens)
            labels[0, torch.from_numpy(cu[:-1].astype(np.int64))] = self.ignore_index
            out[_LABELS] = labels
        longest = int(lengths.max()) if len(lengths) else 0
        cu_tensor = torch.from_numpy(cu)
        out.update(cu_seq_lens_q=cu_tensor, cu_seq_lens_k=cu_tensor, max_length_q=longest, max_length_k=longest,
                   use_cache=False)  # (see the module docstring)
        return out

    # --- straight from caches' maps -------------------------------------------------------------------------------

    def read_parts(self, parts: list[tuple[Any, np.ndarray]]) -> dict[str, Any] | None:
        """The batch of the cache rows of ``parts`` (``(RowReader, rows)``: one cache's, or a mixture's sources' in
        turn), copied straight from their maps (``read.heap_batch``), if every row is complete and no writer changed
        a cache meanwhile; None otherwise (the caller gathers with the checks and calls ``from_columns``)."""
        warm = WarmRows(parts)
        if not warm.begin():
            return None
        names, padded, others = self._warm_plan(warm.reader)
        if padded is None:
            return None  # (values the warm path does not pad: the checked path pads them)
        values: dict[str, tuple[Located, torch.dtype]] = {}
        for name, k, dtype in padded:
            located = warm.located(k)
            if located is None:
                return None  # (damage, or a row being rewritten: the checked path reports it or reads it again)
            values[name] = (located, dtype)
        rest: dict[str, Any] = {}
        for name, k in others:
            value = warm.other(k)
            if value is None:
                return None
            rest[name] = value
        try:
            batch = self._assemble(names, values, rest)
        except ValueError:  # (fields of unequal lengths: a writer may have rewritten rows between their reads)
            if warm.unchanged():
                raise
            return None
        return nested(warm.reader, batch) if warm.unchanged() else None

    def _warm_plan(self, reader: Any) -> tuple[list[str], list[tuple[str, int, torch.dtype]] | None,
                                                list[tuple[str, int]]]:
        """For a cache's fields (``reader.fields``): the batch's field names, the padded fields (name, number, the
        dtype they are served in; None if one is not a 1-D field of numbers the warm path pads) and the other fields
        it reads (name, number). Kept per fields list (one cache's, or a mixture's first source's in the batch: its
        sources store their fields alike), so a batch does not decide it again."""
        fields = reader.fields
        kept = self._kept_plans.get(id(fields))
        if kept is not None and kept[0] is fields:  # (the same list: an id is reused only once it is freed)
            return kept[1]
        names = self._kept([f.name for f in fields if f.kind != "json"])
        number = {f.name: k for k, f in enumerate(fields)}
        inner = nested_fields(reader)
        chosen = self._padded_names(names, lambda n: n not in inner and _one_dim(fields[number[n]]), inner)
        padded: list[tuple[str, int, torch.dtype]] | None = [
            (name, number[name], _target(fields[number[name]])) for name in chosen]
        if not all(WarmRows.paddable_field(fields[number[name]]) for name in chosen):
            padded = None
        skipped = self.attention_mask if self._builds(names) or self.flatten else None
        others = [(f.name, k) for k, f in enumerate(fields)
                  if f.name not in chosen and f.name in names and f.name != skipped]
        plan = (names, padded, others)
        if len(self._kept_plans) >= 16:
            self._kept_plans.clear()
        self._kept_plans[id(fields)] = (fields, plan)
        return plan

    def from_columns(self, reader: Any, columns: list[Any]) -> dict[str, Any]:
        """The batch from a checked gather's columns (``RowReader.gather``: fixed arrays, ``RaggedColumn``s)."""
        fields = reader.fields
        names = self._kept([f.name for f in fields if f.kind != "json"])
        number = {f.name: k for k, f in enumerate(fields)}
        inner = nested_fields(reader)
        padded = self._padded_names(names, lambda n: n not in inner and _one_dim(fields[number[n]]), inner)
        values: dict[str, tuple[Located, torch.dtype]] = {}
        for name in padded:
            k = number[name]
            column = columns[k]
            if fields[k].ragged:
                flat, counts, _ = column.merged()
            else:  # a fixed field: its values are of one length
                array = np.asarray(column)
                flat = array.reshape(-1)
                counts = np.full(len(array), array.shape[1] if array.ndim > 1 else 1, np.int64)
            values[name] = (_located(flat, counts), _target(fields[k]))
        rest = {}
        for k, field in enumerate(fields):
            if field.name in values or field.name not in names or (
                    field.name == self.attention_mask and (self._builds(names) or self.flatten)):
                continue
            if field.ragged:
                rest[field.name] = reader._splitters[k](columns[k])
            else:
                rest[field.name] = reader._batch_converters[k](columns[k])
        return nested(reader, self._assemble(names, values, rest))


def _refuse_rows_of_one(values: list[Any], name: str) -> None:
    """A ValueError if ``values``, of a field a tokenizer returns (``TOKEN_FIELDS``), are integer tensors or arrays
    of shape ``(1, n)`` of different ``n``: its ``return_tensors="pt"`` per sample. Nothing pads them
    (``default_collate`` refuses them, a cache would hand them back as a list), and a model takes neither. Other
    fields of such shapes (mono audio, grayscale images) are collated as they always were."""
    if name not in TOKEN_FIELDS or not values or not all(
            isinstance(v, (torch.Tensor, np.ndarray)) and v.ndim == 2 and v.shape[0] == 1 and not (
                v.dtype.is_floating_point or v.dtype.is_complex or v.dtype == torch.bool
                if isinstance(v, torch.Tensor) else v.dtype.kind not in "iu") for v in values):
        return
    shapes = list(dict.fromkeys(tuple(v.shape) for v in values))
    if len(shapes) > 1:
        raise ValueError(f"TextCollate pads 1-D values; field {name!r} holds values of shapes {shapes[0]}, "
                         f"{shapes[1]}...: a tokenizer's return_tensors='pt' gives (1, n) per sample: return 1-D "
                         "values from the dataset (squeeze(0), or leave return_tensors out)")


def _nothing_to_flatten(names: list[str]) -> ValueError:
    """A flattened batch with no row of tokens: its cu_seq_lens would say it holds none, whatever it holds."""
    return ValueError(f"TextCollate(flatten=True) finds no 1-D field of numbers to flatten among {names}: give each "
                      "sample's token ids as a 1-D tensor, array or list (a tokenizer's return_tensors='pt' gives "
                      "(1, n): squeeze(0) them, or leave return_tensors out)")


def _collated(values: list[Any]) -> Any:
    """A field the batch does not pad, collated as ``default_collate`` collates it, except that a 1-D list of numbers
    (token ids, scores) stays each sample's list, at any depth: as a cache stores such a list (ragged, its lengths
    free) and gives it back (``default_collate`` would transpose lists of one length into a tensor per position, and
    refuse lists of several)."""
    first = values[0]
    if type(first) is list and all(type(v) is list for v in values) and all(_numbers(v) for v in values):
        return values
    if isinstance(first, Mapping):
        return {key: _collated([v[key] for v in values]) for key in first}
    if isinstance(first, tuple) and hasattr(type(first), "_fields"):
        return type(first)(*(_collated([v[k] for v in values]) for k in range(len(first))))
    if isinstance(first, tuple) and all(isinstance(v, tuple) and len(v) == len(first) for v in values):
        return [_collated([v[k] for v in values]) for k in range(len(first))]
    return default_collate(values)


def _chosen(path: str, columns: frozenset[str]) -> bool:
    """Whether ``columns`` names the field (or key) at ``path``, or a key it lies under."""
    return path in columns or ("." in path and any(path.startswith(c + ".") for c in columns))


def _pruned(value: Any, path: str, columns: frozenset[str]) -> Any:
    """A sample's nested value (at ``path``) with only what ``columns`` names (a cache's batch leaves the others
    out, its sequences as lists of what is kept)."""
    if _chosen(path, columns):
        return value
    if isinstance(value, Mapping):
        return {k: _pruned(v, f"{path}.{k}", columns) for k, v in value.items()
                if _wanted(f"{path}.{k}", v, columns)}
    if isinstance(value, (list, tuple)):
        kept = [_pruned(v, f"{path}.{k}", columns) for k, v in enumerate(value) if _wanted(f"{path}.{k}", v, columns)]
        if isinstance(value, list):
            return kept
        # (a namedtuple whole stays one, as from a cache; a tuple, or a namedtuple with parts left out, is collated
        # as a tuple is, position by position)
        return type(value)(*kept) if len(kept) == len(value) and hasattr(type(value), "_fields") else tuple(kept)
    return value


def _wanted(path: str, value: Any, columns: frozenset[str]) -> bool:
    """Whether a nested value stays: named, holding a field named, or an empty dict or tuple (no field to leave
    out: a cache's batch keeps it too)."""
    return _chosen(path, columns) or any(c.startswith(path + ".") for c in columns) or (
        isinstance(value, (Mapping, tuple)) and not value)


def _paths(sample: Mapping[str, Any]) -> set[str]:
    """A sample's keys and the paths of the fields under them (``"meta.source"``, ``"pair.0"``), as a cache names
    its fields: through dicts, tuples and lists of anything but numbers (a list of numbers is one field)."""
    paths: set[str] = set()

    def walk(value: Any, path: str) -> None:
        paths.add(path)
        if isinstance(value, Mapping):
            for k, v in value.items():
                walk(v, f"{path}.{k}")
        elif isinstance(value, tuple) or (isinstance(value, list) and not _numbers(value)):
            for k, v in enumerate(value):
                walk(v, f"{path}.{k}")

    for key, value in sample.items():
        walk(value, key)
    return paths


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))



def _sequences(values: list[Any]) -> bool:
    """Whether a field's values are 1-D sequences of numbers (tensors, arrays, lists), whatever their lengths:
    decided by their type, never by whether this batch's lengths differ, so every batch has the same keys."""
    first = values[0]
    if isinstance(first, torch.Tensor):
        return first.ndim == 1 and not first.dtype.is_complex
    if isinstance(first, np.ndarray):
        return first.ndim == 1 and first.dtype.kind in "biuf"
    if isinstance(first, list):  # (tensors or arrays among them: sources that give ids in both forms)
        return all(_numbers(v) if isinstance(v, list) else
                   isinstance(v, (torch.Tensor, np.ndarray)) and v.ndim == 1 for v in values)
    return False


def _numbers(values: list[Any]) -> bool:
    """Whether a list holds numbers only (ints, floats, bools, numpy's), asked once per type in it (a list of token
    ids holds hundreds of ints: an isinstance each cost 4x the padding over samples of lists)."""
    return all(kind in _NUMBER_TYPES or (issubclass(kind, (int, float, np.integer, np.floating)) and not issubclass(
        kind, (str, bytes))) for kind in set(map(type, values)))


_NUMBER_TYPES = frozenset((int, float, bool))


def _one_dim(field: Any) -> bool:
    """Whether a cache's field is a 1-D field of numbers (ragged or fixed: what ``TextCollate`` pads)."""
    return len(field.shape) == 1 and field.kind in ("tensor", "ndarray", "pylist") and not field.variable


def _arrays(values: list[Any]) -> tuple[list[np.ndarray], torch.dtype]:
    """A field's values as numpy arrays of one dtype, and the dtype the batch holds them in
    (``collate.typed_alike``: the non-empty values', promoted as ``torch.cat`` promotes where they differ); a batch
    of empty values keeps the first tensor's or array's dtype, and lists of none are int64."""
    first = next((v for v in values if not isinstance(v, list)), None)
    if first is None:
        return typed_alike(values, torch.int64)
    return typed_alike(values, first.dtype if isinstance(first, torch.Tensor) else torch_of(
        np.asarray(first).dtype.newbyteorder("=")))


def _target(field: Any) -> torch.dtype:
    """The torch dtype a field's values are served as (the source's, also where they are stored narrower)."""
    if field.torch_dtype is not None:
        return getattr(torch, field.torch_dtype)
    return torch.from_numpy(np.zeros(0, field.np_dtype)).dtype



def _pad_of_tokenizer(pad: Any) -> Any:
    """``pad``, or a Hugging Face tokenizer's pad id where ``pad`` is one (checked: it has a pad token, and pads on
    the right, the side ``TextCollate`` pads)."""
    if isinstance(pad, Mapping) or _is_int(pad) or not hasattr(pad, "pad_token_id"):
        return pad
    if pad.pad_token_id is None:
        raise ValueError("TextCollate(pad=tokenizer): the tokenizer has no pad token; give it one "
                         "(tokenizer.pad_token = tokenizer.eos_token, as for GPT-2) or pass pad=<an id>")
    if getattr(pad, "padding_side", "right") != "right":
        raise ValueError(f"TextCollate(pad=tokenizer): the tokenizer pads on the {pad.padding_side} (as for "
                         "generation), TextCollate on the right, as training batches are padded; pass "
                         "pad=tokenizer.pad_token_id to pad on the right")
    return int(pad.pad_token_id)


def _label_dtype(dtype: torch.dtype) -> torch.dtype:
    """Labels' dtype: int64 for integers of any width (as Hugging Face's collators return them: losses take int64,
    and -100 fits no unsigned type), a float or complex dtype as it is (soft or multi-hot labels)."""
    return dtype if dtype.is_floating_point or dtype.is_complex else torch.int64


def _located(flat: np.ndarray, lengths: np.ndarray) -> Located:
    """Values given back to back, as ``Located``."""
    return Located([(flat, np.cumsum(lengths) - lengths, lengths)], lengths)


def _padded(located: Located, pad: int, dtype: torch.dtype, width: int) -> torch.Tensor:
    return padded_tensor(located, pad, dtype, width)
