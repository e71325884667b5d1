"""The worker side under Dask: installed stacks, heartbeat metrics, trimming, admission. Not here:
the entry points (:mod:`dask_rmm.plugin`, :mod:`dask_rmm.preload`), :mod:`dask_rmm.pressure`.
"""
