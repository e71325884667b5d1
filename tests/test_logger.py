"""The debug logger: RMM's levels, flush level, should_log, output layout."""

from __future__ import annotations

import io
import re

import pytest

from dask_rmm import logger
from dask_rmm.logger import level_enum


@pytest.fixture(autouse=True)
def _restore():
    yield
    logger._reset_for_tests()


def test_levels_round_trip():
    assert [m.name for m in level_enum] == [
        "trace",
        "debug",
        "info",
        "warn",
        "error",
        "critical",
        "off",
    ]
    assert logger.get_logging_level() is level_enum.info
    for level in level_enum:
        logger.set_logging_level(level)
        assert logger.get_logging_level() is level
    logger.set_logging_level("warn")
    assert logger.get_logging_level() is level_enum.warn


@pytest.mark.parametrize("level", ["INFO", "WARNING", 3, "invalid", 100, None, 1.5, [1]])
def test_invalid_levels_raise_type_error_as_rmm(level):
    for call in (logger.set_logging_level, logger.set_flush_level, logger.should_log):
        with pytest.raises(TypeError, match="level must be"):
            call(level)
    assert logger.get_logging_level() is level_enum.info


def test_should_log():
    logger.set_logging_level(level_enum.warn)
    assert not logger.should_log(level_enum.info)
    assert logger.should_log(level_enum.warn) and logger.should_log("critical")
    logger.set_logging_level("trace")
    assert logger.should_log(level_enum.trace)
    assert not logger.should_log(level_enum.off)
    logger.set_logging_level("off")
    assert not logger.should_log(level_enum.critical)


def test_flush_level():
    assert logger.get_flush_level() is level_enum.warn
    logger.flush_on(level_enum.error)
    assert logger.get_flush_level() is level_enum.error
    logger.set_flush_level("trace")
    assert logger.get_flush_level() is level_enum.trace


def test_bad_levels():
    with pytest.raises(TypeError):
        logger.set_logging_level(3)
    with pytest.raises(TypeError, match="level must be"):
        logger.set_logging_level("loud")
    with pytest.raises(TypeError):
        logger.should_log(None)


class _Stream(io.StringIO):
    flushes = 0

    def flush(self):
        self.flushes += 1
        super().flush()


def test_layout_and_flush_on_level():
    log = logger.get_logger()
    handler = log.handlers[0]
    stream = _Stream()
    old = handler.setStream(stream)
    try:
        logger.set_logging_level("debug")
        logger.flush_on("error")
        log.debug("hello %d", 5)
        assert stream.flushes == 0
        log.error("bad")
        assert stream.flushes == 1
        logger.flush_logger()
        assert stream.flushes == 2
    finally:
        handler.setStream(old)
    first, second = stream.getvalue().splitlines()
    assert re.match(r"^\[\s*\d+\]\[\d\d:\d\d:\d\d:\d{6}\]\[debug \] hello 5$", first), first
    assert second.endswith("[error ] bad")


def test_top_level_exports():
    import dask_rmm

    assert dask_rmm.level_enum is level_enum
    assert dask_rmm.flush_on is logger.set_flush_level
