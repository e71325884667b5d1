"""Which stored objects to spill: least recently used first, or, for an allocation a pool could
not serve, the cheapest set whose blocks, once freed, merge with free neighbours into one block
large enough. Pure functions on addresses; no Dask, no CUDA."""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Hashable, Sequence

__all__ = ["Candidate", "coalescing_victims", "lru_victims"]

#: ``(key, nbytes, ptrs)``: a spillable object, its device bytes and the block addresses it
#: holds; candidates come least recently used first.
Candidate = tuple[Hashable, int, Sequence[int]]


def lru_victims(candidates: Sequence[Candidate], need: int) -> list[Hashable]:
    """The least recently used candidates whose bytes add up to at least ``need`` (all of them
    if they do not)."""
    totals = itertools.accumulate(nbytes for _, nbytes, _ in candidates)
    return [key for (key, n, _), total in zip(candidates, totals, strict=True) if total - n < need]


def coalescing_victims(
    candidates: Sequence[Candidate],
    request: int,
    chunks: Sequence[tuple[int, int]],
    free: Sequence[tuple[int, int]],
    live: Sequence[tuple[int, int]],
) -> list[Hashable] | None:
    """The cheapest candidates to spill so that a free range of ``request`` bytes appears.

    ``chunks``, ``free`` and ``live`` are a pool's layout (``PoolMemoryResource.memory_layout``):
    sorted ``(ptr, size)``; free and live blocks tile each chunk and never merge across one. A
    window of adjacent blocks inside one chunk, made of free blocks and candidates' blocks only,
    at least ``request`` long, is a way to serve the request; the one with the fewest candidate
    bytes wins (ties: the one with the least recently used candidates). A live block is a
    candidate's when one of the candidate's pointers falls anywhere inside it; a block holding
    several candidates (a library cache's block carved into several arrays) is freed only with
    all of them. Returns None when no such window exists (other live blocks are in the way
    everywhere).
    """
    # The live block each candidate's pointers fall in: a library cache (CuPy's MemoryPool)
    # carves several arrays out of one block, freed only once every one of them is spilled.
    live_sorted = sorted(live)
    live_starts = [p for p, _ in live_sorted]
    owners: dict[int, set[int]] = {}
    for candidate_rank, (_key, _nbytes, ptrs) in enumerate(candidates):
        for p in ptrs:
            i = bisect.bisect_right(live_starts, p) - 1
            if i >= 0 and p < live_starts[i] + live_sorted[i][1]:
                owners.setdefault(live_starts[i], set()).add(candidate_rank)
    # Segments in address order: (ptr, size, owner ranks; () for free, None for a barrier).
    segments: list[tuple[int, int, tuple[int, ...] | None]] = [(p, s, ()) for p, s in free]
    segments += [(p, s, tuple(sorted(owners[p])) if p in owners else None) for p, s in live_sorted]
    segments.sort()
    chunk_starts = sorted({start for start, _ in chunks})

    # Over each run of mergeable segments (free or candidates', in one chunk), the shortest
    # window of at least ``request`` bytes ending at each segment: the cheapest ending there.
    best: tuple[int, int, list[int]] | None = None  # (cost, worst rank, ranks)
    run: list[tuple[int, tuple[int, ...]]] = []
    run_chunk = lo = length = cost = 0
    for ptr, size, ranks_here in segments:
        chunk = bisect.bisect_right(chunk_starts, ptr)
        if ranks_here is None or chunk != run_chunk or not run:
            run, run_chunk, lo, length, cost = [], chunk, 0, 0, 0
            if ranks_here is None:
                continue
        run.append((size, ranks_here))
        length += size
        cost += size if ranks_here else 0
        while length - run[lo][0] >= request:
            length -= run[lo][0]
            cost -= run[lo][0] if run[lo][1] else 0
            lo += 1
        if length >= request and (best is None or cost <= best[0]):
            ranks = sorted({r for _, rs in run[lo:] for r in rs})
            found = (cost, ranks[-1] if ranks else -1, ranks)
            if best is None or found[:2] < best[:2]:
                best = found
    return None if best is None else [candidates[r][0] for r in best[2]]
