"""The read-only /dask-rmm pages on the scheduler's HTTP server: the report as HTML (timeline as
inline SVG, no JavaScript or CDN) and /dask-rmm/report.json. Added by SchedulerTimelinePlugin.start;
no user config. The report data itself comes from dask_rmm.cluster.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from tornado import web

from dask_rmm.cluster import PLUGIN_NAME, SchedulerTimelinePlugin
from dask_rmm.report import ClusterMemoryReport

if TYPE_CHECKING:
    from distributed import Scheduler

__all__ = ["PAGE_PATH", "JSON_PATH", "install_routes"]

PAGE_PATH = "dask-rmm"
JSON_PATH = "dask-rmm/report.json"

_NOT_INSTALLED = "the dask-rmm scheduler plugin is not installed on this scheduler"


class _ReportHandler(web.RequestHandler):
    def initialize(self, dask_server: Scheduler) -> None:
        self.server = dask_server

    def _plugin(self) -> SchedulerTimelinePlugin | None:
        plugin = self.server.plugins.get(PLUGIN_NAME)
        return plugin if isinstance(plugin, SchedulerTimelinePlugin) else None

    def _flag(self, name: str, default: bool) -> bool:
        value = self.get_query_argument(name, None)
        return default if value is None else value.lower() not in ("0", "false", "no", "")

    def _int(self, name: str) -> int | None:
        value = self.get_query_argument(name, None)
        try:
            return None if value is None else max(0, int(value))
        except ValueError:
            raise web.HTTPError(
                400, f"query argument {name} must be an integer, got {value!r}"
            ) from None


class ReportPage(_ReportHandler):
    """``GET /dask-rmm[?timeline=0][&last=N][&refresh=SECONDS]``: the report as a web page."""

    def get(self) -> None:
        plugin = self._plugin()
        if plugin is None:
            raise web.HTTPError(404, _NOT_INSTALLED)
        data = plugin.report_data(timeline=self._flag("timeline", True), last=self._int("last"))
        report = ClusterMemoryReport.from_dict(data)
        self.set_header("Content-Type", "text/html; charset=utf-8")
        self.write(report.to_html(full_page=True, refresh=self._int("refresh")))


class ReportJSON(_ReportHandler):
    """``GET /dask-rmm/report.json[?timeline=0][&last=N]``: the ``ClusterMemoryReport.to_dict()`` data."""

    def get(self) -> None:
        plugin = self._plugin()
        if plugin is None:
            raise web.HTTPError(404, _NOT_INSTALLED)
        data = plugin.report_data(timeline=self._flag("timeline", True), last=self._int("last"))
        self.set_header("Content-Type", "application/json")
        self.write(json.dumps(data))


def _http_prefix(app: Any) -> str:
    """The scheduler's ``--dashboard-prefix``: the Scheduler does not keep it, so read it off
    the route distributed always adds (``<prefix>health``)."""
    import tornado.routing

    stack = [app.default_router]
    while stack:
        router = stack.pop()
        for rule in getattr(router, "rules", []):
            if isinstance(rule.matcher, tornado.routing.PathMatches):
                pattern = rule.matcher.regex.pattern.rstrip("$")
                if pattern.endswith("/health"):
                    return pattern[: -len("health")]
            if isinstance(rule.target, tornado.routing.RuleRouter):
                stack.append(rule.target)
    return "/"


def install_routes(scheduler: Scheduler) -> bool:
    """Add the /dask-rmm pages to ``scheduler``'s HTTP server once; True if added now."""
    app = getattr(scheduler, "http_application", None)
    if app is None or getattr(app, "_dask_rmm_routes", False):
        return False
    prefix = _http_prefix(app)
    kwargs = {"dask_server": scheduler}
    app.add_handlers(
        r".*$",
        [
            (prefix + JSON_PATH, ReportJSON, kwargs),
            (prefix + PAGE_PATH, ReportPage, kwargs),
        ],
    )
    app._dask_rmm_routes = True
    return True
