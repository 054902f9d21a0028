"""Sphinx configuration: the user guide, the format, the guarantees, the architecture and the benchmark's results
(Markdown, through MyST), and the API reference rendered from the docstrings (autodoc, Google style through
napoleon). Built by ``tests/test_docs.py`` with warnings as errors, so a broken docstring or link fails CI."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.abspath(".."))

project = "mmapcache"
author = "the mmapcache developers"
extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]
myst_heading_anchors = 3  # "[x](guide.md#fields-whose-shape-varies)" links to a heading
autodoc_member_order = "bysource"
autodoc_typehints = "description"  # type hints beside each argument, not in a signature of 20 options
napoleon_google_docstring = True
napoleon_numpy_docstring = False
html_theme = "alabaster"
html_static_path: list[str] = []
