"""Writing an output file safely: never over one of the command's inputs, never half-written.
Every dask-rmm command that writes a file goes through :func:`atomic_output`."""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
from collections.abc import Iterable, Iterator
from typing import Any

__all__ = ["atomic_output", "refuse_input", "save_figure"]


def refuse_input(path: str | os.PathLike, inputs: Iterable[str | os.PathLike]) -> None:
    """Raise ValueError if ``path`` is one of ``inputs`` (the same file, also through a link
    or another spelling of its path)."""
    if os.path.exists(path):
        for source in inputs:
            if os.path.exists(source) and os.path.samefile(path, source):
                raise ValueError(
                    f"refusing to write {os.fspath(path)}: it is also an input ({os.fspath(source)})"
                )


@contextlib.contextmanager
def atomic_output(
    path: str | os.PathLike, inputs: Iterable[str | os.PathLike] = ()
) -> Iterator[str]:
    """Yield a temporary path beside ``path`` (same extension) to write, renamed to ``path`` on
    success, removed on an error. A link is followed; a target that is not a regular file (a
    device, a FIFO) is written in place. ValueError if ``path`` is one of ``inputs``."""
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise TypeError(f"the output must be a file path, got {path!r}")
    if os.path.isdir(path):
        raise IsADirectoryError(errno.EISDIR, "the output is a directory, not a file", path)
    if not os.path.isdir(os.path.dirname(os.path.realpath(path))):
        raise FileNotFoundError(errno.ENOENT, "the output's directory does not exist", path)
    refuse_input(path, inputs)
    if os.path.exists(path) and not stat.S_ISREG(os.stat(path).st_mode):
        try:
            yield os.fspath(path)
        except OSError as e:  # a write's error names no file
            e.filename = e.filename or os.fspath(path)
            raise
        return
    target = os.path.realpath(path)  # a link keeps pointing at the new file
    directory, name = os.path.split(target)
    fd, tmp = tempfile.mkstemp(
        prefix=f".{name}.", suffix=f".partial{os.path.splitext(name)[1]}", dir=directory
    )
    os.close(fd)
    try:
        yield tmp
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(
            tmp, os.stat(target).st_mode & 0o7777 if os.path.exists(target) else 0o666 & ~umask
        )
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def save_figure(figure: Any, path: str | os.PathLike, **kwargs: Any) -> None:
    """``figure.savefig`` through :func:`atomic_output`, in the format of ``path``'s extension
    (PNG without one: matplotlib would read the temporary name's instead)."""
    with atomic_output(path) as tmp:
        figure.savefig(tmp, format=os.path.splitext(path)[1][1:] or "png", **kwargs)
