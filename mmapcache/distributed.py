"""Distributed jobs: ``prefill``, the cooperative filling of a node's cache by its ranks (``fill.prefill``), and
``local_rank_and_size``, this process's rank among the ranks of its node that share a cache (``store.share``)."""

from __future__ import annotations

from .fill.prefill import DEFAULT_PATIENCE, prefill
from .store.share import local_rank_and_size

__all__ = ["DEFAULT_PATIENCE", "local_rank_and_size", "prefill"]
