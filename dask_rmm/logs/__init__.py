"""Allocation-log tools: read RMM's CSV logs (``reader``), summarize them (``summary``), draw
bytes in use over time (``timeline``) and re-issue them on a fresh resource (``replay``).
No Dask; ``dask rmm log ...`` is their command line.
"""

from dask_rmm.logs import reader
from dask_rmm.logs.reader import *  # noqa: F403  (the reader's names are the package's)

__all__ = list(reader.__all__)
