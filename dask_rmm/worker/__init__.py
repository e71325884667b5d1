"""The worker side of dask-rmm under Dask: the stacks installed on a worker
(:mod:`~dask_rmm.worker.stacks`), its heartbeat metrics (:mod:`~dask_rmm.worker.metrics`), giving pooled memory
back (:mod:`~dask_rmm.worker.trim`). The entry points are
:mod:`dask_rmm.plugin` and :mod:`dask_rmm.preload`; memory pressure is :mod:`dask_rmm.pressure`.
"""
