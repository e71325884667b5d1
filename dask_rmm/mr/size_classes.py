"""The size classes of the pool and the arena: sizes in 256-byte units, their class formulas and
the lookup tables the fast paths index."""

from __future__ import annotations

from collections.abc import Iterator
from itertools import compress

from dask_rmm.sizes import ALIGNMENT

__all__ = [
    "CACHED_LIMIT",
    "CLASS_INDEXES",
    "EXACT_BITS",
    "INSERT_CLASS",
    "N_CLASSES",
    "ROUNDED_BYTES",
    "SEARCH_CLASS",
    "SUBCLASS_BITS",
    "TABLE_UNITS",
    "UNIT_SHIFT",
    "class_floor",
    "drain_cache",
    "insert_class",
    "pop_all",
    "search_class",
]

#: Sizes are counted in units of :data:`~dask_rmm.mr.base.ALIGNMENT` bytes: ``u = nbytes >> 8``.
UNIT_SHIFT = ALIGNMENT.bit_length() - 1
#: Classes per power of two: ``1 << SUBCLASS_BITS`` (TLSF's second-level index bits).
SUBCLASS_BITS = 4
#: Sizes below ``1 << EXACT_BITS`` units have a class each; above, a class is 1/16 of an octave.
EXACT_BITS = SUBCLASS_BITS + 1
_EXACT = 1 << EXACT_BITS
#: Number of classes (covers every size below 2**64 units).
N_CLASSES = 64 << SUBCLASS_BITS
#: The class tables cover sizes below this many units (16 MiB).
TABLE_UNITS = 1 << 16
#: Requests up to this size are rounded up to their search class's floor (at most 1/16 more) and
#: cached per stream when freed; larger ones are placed at their aligned size.
CACHED_LIMIT = (TABLE_UNITS - 1) << UNIT_SHIFT
#: Every class index, for ``itertools.compress`` over a per-class list.
CLASS_INDEXES = range(N_CLASSES)


def insert_class(u: int) -> int:
    """The class a free block of ``u`` units is filed under (its size's floor class)."""
    if u < _EXACT:
        return u
    shift = u.bit_length() - EXACT_BITS
    return (shift << SUBCLASS_BITS) + (u >> shift)


def search_class(u: int) -> int:
    """The first class all of whose blocks are at least ``u`` units."""
    if u < _EXACT:
        return u
    shift = u.bit_length() - EXACT_BITS
    c = (shift << SUBCLASS_BITS) + (u >> shift)
    return c + 1 if u & ((1 << shift) - 1) else c


def class_floor(c: int) -> int:
    """The smallest size (in units) filed under class ``c``."""
    if c < _EXACT:
        return c
    return ((c & ((1 << SUBCLASS_BITS) - 1)) + (1 << SUBCLASS_BITS)) << ((c >> SUBCLASS_BITS) - 1)


def pop_all(blocks: list[int]) -> Iterator[int]:
    """Every block of ``blocks``, one ``pop`` at a time (lock-free callers may pop or append
    meanwhile)."""
    while blocks:
        try:
            yield blocks.pop()
        except IndexError:
            break


def drain_cache(cache: list[list[int]]) -> Iterator[tuple[int, int]]:
    """Take every block out of a per-class cache (:func:`pop_all`): ``(ptr, its class floor in
    bytes)``."""
    for c in compress(CLASS_INDEXES, cache):  # the non-empty classes, found in C
        size = class_floor(c) << UNIT_SHIFT
        yield from ((ptr, size) for ptr in pop_all(cache[c]))


def _class_tables() -> tuple[list[int], list[int], list[int]]:
    """``(INSERT_CLASS, SEARCH_CLASS, ROUNDED_BYTES)`` below TABLE_UNITS units, built a class
    (a run of equal entries) at a time: 3 x 65536 calls took ~0.15 s of ``import dask_rmm``."""
    ins: list[int] = []
    srch: list[int] = []
    rounded: list[int] = []
    c = 0
    while (lo := class_floor(c)) < TABLE_UNITS:
        nxt = class_floor(c + 1)
        rest = min(nxt, TABLE_UNITS) - lo - 1
        ins += [c] * (rest + 1)
        # A size of exactly the floor searches its own class; any larger one the next class.
        srch.append(c)
        srch += [c + 1] * rest
        rounded.append(lo << UNIT_SHIFT)
        rounded += [nxt << UNIT_SHIFT] * rest
        c += 1
    return ins, srch, rounded


#: ``INSERT_CLASS[u] == insert_class(u)`` for ``u < TABLE_UNITS``.
INSERT_CLASS: list[int]
#: ``SEARCH_CLASS[u] == search_class(u)`` for ``u < TABLE_UNITS``.
SEARCH_CLASS: list[int]
#: ``ROUNDED_BYTES[u]``: the bytes a request of ``u`` units is given, its search class's floor.
ROUNDED_BYTES: list[int]
INSERT_CLASS, SEARCH_CLASS, ROUNDED_BYTES = _class_tables()
