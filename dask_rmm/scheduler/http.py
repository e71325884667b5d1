"""The read-only /dask-rmm pages on the scheduler's HTTP server: the report as HTML (timeline as
inline SVG, no JavaScript) and /dask-rmm/report.json (the report document, as ``dask rmm report
--json`` prints it). Added at runtime by SchedulerTimelinePlugin.start, or at scheduler start by
listing this module in ``distributed.scheduler.http.routes``.
"""

from __future__ import annotations

import json
import weakref
from typing import TYPE_CHECKING, Any

import tornado.routing
from distributed.http.utils import RequestHandler, get_handlers
from tornado import web

from dask_rmm.report.memory_report import ClusterMemoryReport
from dask_rmm.wire import PLUGIN_NAME

if TYPE_CHECKING:
    from distributed import Scheduler

    from dask_rmm.scheduler.timeline import SchedulerTimelinePlugin

__all__ = ["ReportJSON", "ReportPage", "install_routes", "routes"]


class _ReportHandler(RequestHandler):
    def _report(self) -> tuple[ClusterMemoryReport, bool]:
        """The plugin's report, and whether it was asked with timelines."""
        plugin: SchedulerTimelinePlugin | None = self.server.plugins.get(PLUGIN_NAME)
        if plugin is None or not hasattr(plugin, "memory_report"):
            raise web.HTTPError(404, "the dask-rmm scheduler plugin is not installed")
        timeline = self.get_query_argument("timeline", "1").lower() not in ("0", "false", "no", "")
        return plugin.memory_report(timeline=timeline, last=self._int("last")), timeline

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
        report, _ = self._report()
        self.set_header("Content-Type", "text/html; charset=utf-8")
        self.write(report.to_html(full_page=True, refresh=self._int("refresh")))


class ReportJSON(_ReportHandler):
    """``GET /dask-rmm/report.json[?timeline=0][&last=N]``: the report document."""

    def get(self) -> None:
        report, timeline = self._report()
        self.set_header("Content-Type", "application/json")
        self.write(json.dumps(report.to_dict(timeline=timeline)))


#: distributed's route list format: ``(path, handler, kwargs)``.
routes: list[tuple[str, type, dict]] = [
    ("dask-rmm/report.json", ReportJSON, {}),
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
