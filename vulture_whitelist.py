"""Names vulture (the dead-code check in .ci/run, configured in pyproject.toml) cannot see used:
each is called or read by name from outside this repository's code. Not imported by anything."""

# Module __getattr__ / __dir__ (PEP 562): the lazy names of dask_rmm and dask_rmm.mr.
__getattr__
__dir__

# Plugin hooks distributed calls by name (SchedulerPlugin, WorkerPlugin) and flags it reads.
_.add_worker
_.remove_worker
_.teardown
_.transition
_.idempotent

# tornado calls RequestHandler.write_error for an HTTPError, compute_etag for a whole answer.
_.write_error
_.compute_etag

# asyncio's debug mode reads it (bench/scrape_cost.py --why).
_.slow_callback_duration

# Fields of cuda-python's cudaMemPoolProps, read by cudaMemPoolCreate.
_.allocType
_.handleTypes
_.maxSize

# Read by distributed's preload (``dask_setup(worker, dask_cuda_context=...)`` is how
# dask-cuda's CLI calls a preload) and by the `dask rmm advise` click command.
dask_cuda_context
advise

# Kept alive in a threading.local: its __del__ drains the thread's stream at thread exit.
_.drain_at_exit

# PyTorch keeps the allocator object alive through this reference.
_._allocator

# Public names of the API (RMM's or documented) that this repository does not itself call.
logging_level  # rmm.logging_level, RMM's older alias
_.pretty_print  # rmm.statistics.ProfilerRecords.pretty_print
_.charging_pool  # AttributionResourceAdaptor, as counting_pool / tracking_pool
_.paused_devices  # ClusterTotals field (JSON, DataFrame)
_.failed_rows  # ReplayResult field (JSON)
_.device_pointer  # PointerAttributes fields
_.host_pointer

# importlib's Loader protocol and package attribute, used by tools/rmm_compat's import finder.
_.create_module
_.__path__

# pytest: module marks, hooks, autouse fixtures and fixtures asked for by name.
pytestmark
pytest_collection_modifyitems
_reset_global_state
_hooks
_restore
gpu_cupy_allocator
rmm_free_thread
gpu_mr
_reset  # tests/worker/test_admission.py autouse fixture

# DeviceSample wire fields read by name (to_dict, the report's dict and Prometheus).
_.admission_total_held
_.admission_wait_seconds
_.admission_longest_wait_seconds

# click calls it by name (the preload command's -h).
_.get_help_option_names

# reprlib.Repr settings (read by reprlib), and an attribute a recorder script keeps alive.
_.maxstring
_.maxother
_.recorded_buffers

# bench/scheduler_real.py: an idle comm distributed calls by name.
_.closed
_.abort
_.peer_address
_.local_address

# distributed's SpecCluster reads scheduler_comm when it closes (a test of the tests' patient
# close clears it: tests/test_conftest_helpers.py).
_.scheduler_comm

# RMMPlugin.__init__'s arguments reach RMMOptions through locals().
async_alloc

# inspect.signature reads it: the parameters of _cuda's generated runtime calls.
_.__signature__
