"""bench/torch_budget.py's shortening of out-of-memory messages: the GPU fill test reads from it
which limit stopped each library, so the part naming PyTorch's cap must survive on a GPU shared
with many processes (PyTorch lists each of them before that part)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "torch_budget_bench", Path(__file__).resolve().parents[1] / "bench" / "torch_budget.py"
)
assert _spec is not None and _spec.loader is not None
torch_budget = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(torch_budget)

HEAD = "CUDA out of memory. Tried to allocate 32.00 MiB. GPU 0 has a total capacity of 139.80 GiB. "
TAIL = "Of the allocated memory 1.90 GiB is allocated by PyTorch, with 2.00 GiB allowed; ..."


def _listing(n: int) -> str:
    return "".join(f"Process {500 + i} has {i + 1}.50 MiB memory in use. " for i in range(n))


def test_the_cap_survives_a_long_list_of_processes():
    message = HEAD + _listing(40) + TAIL
    assert len(message) > 1000  # a plain cut at 600 would lose "allowed"
    short = torch_budget._short_error(message)
    assert "allowed" in short and short.startswith(HEAD)
    assert "(40 processes' use on the GPU left out)" in short and "Process 5" not in short


def test_a_message_without_a_listing_is_kept_or_cut_with_a_mark():
    assert torch_budget._short_error(HEAD + TAIL) == HEAD + TAIL
    cut = torch_budget._short_error("x" * 700, limit=100)
    assert len(cut) == 100 and cut.endswith("...")
