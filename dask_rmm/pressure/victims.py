"""Which stored objects to spill: least recently used first, or, for an allocation a pool could
not serve, the cheapest set whose blocks, once freed, merge with free neighbours into one block
large enough. Pure functions on addresses; no Dask, no CUDA."""

from __future__ import annotations

import bisect
from collections.abc import Hashable, Sequence

__all__ = ["Candidate", "coalescing_victims", "lru_victims"]

#: ``(key, nbytes, ptrs)``: a spillable object, its device bytes and the block addresses it
#: holds; candidates come least recently used first.
Candidate = tuple[Hashable, int, Sequence[int]]


def lru_victims(candidates: Sequence[Candidate], need: int) -> list[Hashable]:
    """The least recently used candidates whose bytes add up to at least ``need`` (all of them
    if they do not)."""
    out = []
    total = 0
    for key, nbytes, _ptrs in candidates:
        if total >= need:
            break
        out.append(key)
        total += nbytes
    return out


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
    bytes wins (ties: the one with the least recently used candidates). Returns None when no
    such window exists (other live blocks are in the way everywhere).
    """
    owner: dict[int, int] = {}
    for candidate_rank, (_key, _nbytes, ptrs) in enumerate(candidates):
        for p in ptrs:
            owner.setdefault(p, candidate_rank)
    # Segments in address order: (ptr, size, owner rank or -1 for free, or None for a barrier).
    segments: list[tuple[int, int, int | None]] = [(p, s, -1) for p, s in free]
    segments += [(p, s, owner.get(p)) for p, s in live]
    segments.sort()
    chunk_ends = {start: start + size for start, size in chunks}
    chunk_starts = sorted(chunk_ends)

    best: tuple[int, int, list[int]] | None = None  # (cost, worst rank, ranks)

    def consider(window: list[tuple[int, int, int | None]]) -> None:
        nonlocal best
        # Two pointers over one run of mergeable segments.
        lo = 0
        length = 0
        cost = 0
        for hi, (_p, size, rank) in enumerate(window):
            length += size
            if rank is not None and rank >= 0:
                cost += size
            while length - window[lo][1] >= request:
                _p0, s0, r0 = window[lo]
                length -= s0
                if r0 is not None and r0 >= 0:
                    cost -= s0
                lo += 1
            if length >= request and (best is None or cost <= best[0]):
                ranks = sorted({r for _, _, r in window[lo : hi + 1] if r is not None and r >= 0})
                key = (cost, ranks[-1] if ranks else -1)
                if best is None or key < best[:2]:
                    best = (cost, key[1], ranks)

    run: list[tuple[int, int, int | None]] = []
    run_chunk = None
    for seg in segments:
        ptr, size, rank = seg
        i = bisect.bisect_right(chunk_starts, ptr) - 1
        chunk = chunk_starts[i] if i >= 0 else None
        if rank is None or chunk != run_chunk:
            if run:
                consider(run)
            run = []
            run_chunk = chunk
            if rank is None:
                continue
        run.append(seg)
    if run:
        consider(run)
    if best is None:
        return None
    return [candidates[r][0] for r in best[2]]
