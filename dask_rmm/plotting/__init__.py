"""Drawing helpers below both the cluster report and the allocation-log tools: the dashboard's
SVG timeline (``svg``) and matplotlib figure helpers (``figures``). No Dask; matplotlib on first
use only. Not here: what a report or a log plot shows (``dask_rmm.report``, ``dask_rmm.logs``).
"""
