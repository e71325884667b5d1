"""The read-only /dask-rmm pages on the scheduler's HTTP server (the HTML report, report.json,
per-device metrics), built off the event loop; added by SchedulerTimelinePlugin.start, or at start
by listing this module in ``distributed.scheduler.http.routes``. Not here: building reports."""

from __future__ import annotations

import contextlib
import weakref
from typing import TYPE_CHECKING, Any

import dask.config
import tornado.routing
from distributed.http.utils import RequestHandler, get_handlers
from tornado import web

from dask_rmm.scheduler.report_build import SORT_KEYS, ReportRequest
from dask_rmm.wire import PLUGIN_NAME

if TYPE_CHECKING:
    from distributed import Scheduler

    from dask_rmm.scheduler.timeline import SchedulerTimelinePlugin

__all__ = [
    "DeviceMetrics",
    "ReportJSON",
    "ReportPage",
    "ReportPageSlash",
    "install_routes",
    "routes",
]

#: Rows of the page when neither ``?top=`` nor the config says.
DEFAULT_PAGE_ROWS = 50
#: Time buckets of the page's timeline (about its width in pixels).
PAGE_WIDTH = 640
_WRITE_CHUNK = 1 << 20
_BOOL = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}


class _ReportHandler(RequestHandler):
    def _plugin(self) -> SchedulerTimelinePlugin:
        plugin = self.server.plugins.get(PLUGIN_NAME)
        if not hasattr(plugin, "report_async"):
            raise web.HTTPError(404, "the dask-rmm scheduler plugin is not installed")
        return plugin

    def _request(self, page: bool) -> ReportRequest:
        """The query arguments, each checked: a wrong one is a 400 that says what was wrong."""
        known = {"timeline", "last", "top", "sort", "worker"} | ({"refresh"} if page else set())
        if unknown := sorted(set(self.request.query_arguments) - known):
            raise web.HTTPError(
                400,
                f"unknown query argument(s) {', '.join(unknown)}; "
                f"this page takes {', '.join(sorted(known))}",
            )
        timeline = (self.get_query_argument("timeline", None) or ("1" if page else "0")).lower()
        if timeline not in _BOOL:
            raise web.HTTPError(
                400, f"timeline must be 1 or 0 (true/false, yes/no), got {timeline!r}"
            )
        sort = self.get_query_argument("sort", None)
        if sort is not None and sort not in SORT_KEYS:
            raise web.HTTPError(400, f"sort must be one of {', '.join(SORT_KEYS)}, got {sort!r}")
        top = self._int("top", 1, "a number of devices")
        if page and top is None:
            top = dask.config.get("dask-rmm.scheduler.page-rows", default=DEFAULT_PAGE_ROWS)
        return ReportRequest(
            timeline=_BOOL[timeline],
            last=self._int("last", 0, "a number of timeline points"),
            top=top,
            sort=sort,
            worker=self.get_query_argument("worker", None) or None,
            width=PAGE_WIDTH if page else None,
            refresh=self._int("refresh", 1, "a number of seconds") if page else None,
        )

    def _int(self, name: str, least: int, what: str) -> int | None:
        value = self.get_query_argument(name, None)
        if value is None:
            return None
        with contextlib.suppress(ValueError):
            if (number := int(value)) >= least:
                return number
        raise web.HTTPError(400, f"{name} must be {what}, a whole number >= {least}; got {value!r}")

    def compute_etag(self) -> None:
        # tornado hashes the whole body on the event loop for an ETag (150 ms for the 70 MB of
        # /dask-rmm/metrics at 10,000 devices); each answer is a new snapshot's: no ETag.
        return None

    async def write_pieces(self, pieces: Any) -> None:
        """Write ``pieces`` (str or bytes) a megabyte at a time, the event loop free in between
        (tornado joins what a handler wrote before sending it: hundreds of megabytes at once
        for 16,000 devices)."""
        batch: list = []
        size = 0
        for piece in pieces:
            batch.append(piece)
            size += len(piece)
            if size >= _WRITE_CHUNK:
                self.write(_join(batch))
                await self.flush()
                batch, size = [], 0
        self.write(_join(batch))

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        # tornado's default page says only "400: Bad Request"; say what was wrong.
        error = kwargs.get("exc_info", (None, None, None))[1]
        detail = getattr(error, "log_message", None) or ""
        self.set_header("Content-Type", "text/plain; charset=utf-8")
        self.finish(f"{status_code} {self._reason}: {detail}\n" if detail else f"{status_code}\n")


class ReportPage(_ReportHandler):
    """``GET /dask-rmm[?top=N][&sort=current|peak|fragmentation|worker][&worker=TEXT]
    [&timeline=0][&last=N][&refresh=SECONDS]``: the report as a web page."""

    async def get(self) -> None:
        plugin = self._plugin()
        page = await plugin.report_async(self._request(page=True), "html")
        self.set_header("Content-Type", "text/html; charset=utf-8")
        self.write(page)


class ReportJSON(_ReportHandler):
    """``GET /dask-rmm/report.json[?timeline=1][&last=N][&top=N][&sort=...][&worker=TEXT]``:
    the report document (every device, no per-device timelines unless ``timeline=1``)."""

    async def get(self) -> None:
        plugin = self._plugin()
        pieces = await plugin.report_async(self._request(page=False), "json-pieces")
        self.set_header("Content-Type", "application/json")
        await self.write_pieces(pieces)


class DeviceMetrics(_ReportHandler):
    """``GET /dask-rmm/metrics``: every running device's series in the Prometheus text format,
    at any cluster size (``/metrics`` has them up to ``prometheus-device-limit`` devices), made
    off the event loop once per shared snapshot and served to every scrape of it."""

    async def get(self) -> None:
        plugin = self._plugin()
        try:
            from dask_rmm.scheduler.prometheus import device_text
        except ImportError:
            raise web.HTTPError(404, "prometheus_client is not installed") from None
        self.set_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
        await self.write_pieces(await plugin.exported("text", device_text))


def _join(batch: list) -> Any:
    return b"".join(batch) if batch and isinstance(batch[0], bytes) else "".join(batch)


class ReportPageSlash(RequestHandler):
    """``GET /dask-rmm/``: a permanent redirect to ``/dask-rmm`` (query kept), so that the
    page's relative links resolve as they do from ``/dask-rmm``."""

    def get(self) -> None:
        query = self.request.query
        self.redirect(self.request.path.rstrip("/") + (f"?{query}" if query else ""), True)


#: distributed's route list format: ``(path, handler, kwargs)``.
routes: list[tuple[str, type, dict]] = [
    ("dask-rmm/report.json", ReportJSON, {}),
    ("dask-rmm/metrics", DeviceMetrics, {}),
    ("dask-rmm/", ReportPageSlash, {}),
    ("dask-rmm", ReportPage, {}),
]

_installed: weakref.WeakSet = weakref.WeakSet()


def _http_prefix(app: Any) -> str:
    """The scheduler's ``--dashboard-prefix`` (the Scheduler does not keep it): read off the
    ``<prefix>health`` route distributed always adds."""
    stack = [app.default_router]
    while stack:
        for rule in getattr(stack.pop(), "rules", []):
            if isinstance(rule.matcher, tornado.routing.PathMatches):
                pattern = rule.matcher.regex.pattern.rstrip("$")
                if pattern.endswith("/health"):
                    return pattern[: -len("health")]
            if isinstance(rule.target, tornado.routing.RuleRouter):
                stack.append(rule.target)
    return "/"


def install_routes(scheduler: Scheduler) -> bool:
    """Add :data:`routes` to ``scheduler``'s HTTP server once; True if added now."""
    app = getattr(scheduler, "http_application", None)
    if app is None or app in _installed:
        return False
    app.add_handlers(r".*$", get_handlers(scheduler, [__name__], _http_prefix(app)))
    _installed.add(app)
    return True
