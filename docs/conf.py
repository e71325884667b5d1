"""Sphinx configuration: the API reference from the numpydoc docstrings, plus the markdown pages.

Build (what .ci/run does; warnings are errors): ``sphinx-build -W -b html docs docs/_build/html``.
"""

from __future__ import annotations

import dask_rmm

project = "dask-rmm"
author = "dask-rmm developers"
release = version = dask_rmm.__version__

extensions = ["sphinx.ext.autodoc", "numpydoc", "myst_parser"]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build"]
html_theme = "alabaster"

# Classes list their documented methods through autodoc's :members:; numpydoc's own member
# tables would need autosummary stub pages for every method.
numpydoc_show_class_members = False
numpydoc_class_members_toctree = False
autodoc_member_order = "bysource"
# Signatures as written in the source (from __future__ import annotations), not evaluated.
autodoc_typehints = "none"
# Headings in the markdown pages get anchors, so "page.md#section" links resolve.
myst_heading_anchors = 3
