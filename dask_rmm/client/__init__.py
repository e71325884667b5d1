"""What a client calls, above the scheduler: :func:`~dask_rmm.client.fetch.cluster_report`
(fetch), :class:`~dask_rmm.client.sampler.GPUMemorySampler` (samples over a block of work),
:func:`~dask_rmm.client.performance.performance_report` and sizing advice
(:mod:`~dask_rmm.client.advice`). Not here: the report's data model and renderings
(:mod:`dask_rmm.report`), the scheduler side (:mod:`dask_rmm.scheduler`).
"""
