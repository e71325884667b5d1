"""The scheduler's side of RMMPlugin's all-or-nothing setup: :class:`SetupCoordinator` counts
one vote per worker per registration and, on a failure, puts the scheduler's record of the plugin
back. Not here: what a worker builds and installs (:mod:`dask_rmm.plugin`).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from distributed.diagnostics.plugin import SchedulerPlugin

if TYPE_CHECKING:
    from distributed import Scheduler

__all__ = ["VOTE_TIMEOUT", "SetupCoordinator", "register_on_every_worker"]

logger = logging.getLogger("distributed.scheduler.dask_rmm")

#: How long a worker's setup waits for the other workers' votes.
VOTE_TIMEOUT = 60.0

_UNREADABLE = object()


@dataclass
class _Round:
    token: str
    name: str
    plugin: Any  # what the scheduler stored for this registration (None: a later one already)
    expected: set[str]
    votes: dict[str, tuple[str | None, str | None]] = field(default_factory=dict)
    failures: dict[str, str] | None = None  # None until decided
    done: asyncio.Event = field(default_factory=asyncio.Event)


class SetupCoordinator(SchedulerPlugin):
    """The scheduler's side of RMMPlugin's all-or-nothing setup: one vote per registration.

    Adds the ``dask_rmm_setup_vote`` handler. Every worker that got the registration votes with
    its error (or None) once its stacks are built; the answer, once every worker present at the
    first vote has voted (or left, or ``VOTE_TIMEOUT`` passed), is the failures. On a failure the
    scheduler's record of the worker plugin goes back to the registration the workers keep (or
    is dropped), so that workers added later start like the others.
    """

    name = "dask-rmm-setup"
    idempotent = True
    #: Committed registrations remembered (token -> what the scheduler stored).
    KEEP = 16

    def __init__(self) -> None:
        self.rounds: dict[str, _Round] = {}
        self.committed: dict[str, Any] = {}
        self.scheduler: Scheduler | None = None

    async def start(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        scheduler.handlers["dask_rmm_setup_vote"] = self.vote

    def remove_worker(self, scheduler: Scheduler, worker: str, **kwargs: Any) -> None:
        for r in list(self.rounds.values()):
            r.expected.discard(worker)
            self._decide_if_complete(r)

    async def vote(
        self,
        token: str,
        name: str,
        worker: str,
        error: str | None = None,
        previous: str | None = None,
    ) -> dict[str, Any]:
        """``{"failures": {worker: reason}, "current": bool, "joined": bool}``: ``current`` is
        False when the scheduler holds a later registration of the plugin (two registered at
        once: the later one is installed everywhere, whatever order the workers received them
        in); ``joined`` is True for a worker added after the registration succeeded on the
        others (it gets the plugin when it registers, and fails alone)."""
        joined = token in self.committed
        failures = await self._failures(token, name, worker, error, previous)
        stored = self._stored_token(name)
        return {
            "failures": failures,
            "current": stored == token or stored is _UNREADABLE,
            "joined": joined,
        }

    def _stored_token(self, name: str) -> Any:
        """The token of the registration the scheduler holds: None when it holds none (the
        plugin was unregistered), ``_UNREADABLE`` when it cannot tell."""
        assert self.scheduler is not None
        plugin = self.scheduler.worker_plugins.get(name)
        if isinstance(plugin, bytes):
            from distributed.protocol.pickle import loads

            try:
                plugin = loads(plugin)
            except Exception:
                return _UNREADABLE
        return None if plugin is None else getattr(plugin, "token", _UNREADABLE)

    async def _failures(
        self, token: str, name: str, worker: str, error: str | None, previous: str | None
    ) -> dict[str, str]:
        alone = {worker: error} if error else {}
        if token in self.committed:  # a worker added after the registration succeeded
            return alone
        r = self.rounds.get(token)
        if r is not None and r.failures and worker in r.votes:
            # This worker voted in that failed round already: the same plugin object is being
            # registered again (a retry once the cause is fixed), which gets a round of its own.
            r = None
        if r is None:
            assert self.scheduler is not None
            stored = self.scheduler.worker_plugins.get(name)
            r = self.rounds[token] = _Round(
                token,
                name,
                stored if self._stored_token(name) in (token, _UNREADABLE) else None,
                set(self.scheduler.workers),
            )
            decided = [t for t, x in self.rounds.items() if x.failures is not None]
            for t in decided[: max(0, len(decided) - self.KEEP)]:
                del self.rounds[t]
        if r.failures is not None:
            return r.failures or alone
        r.votes[worker] = (error, previous)
        self._decide_if_complete(r)
        try:
            await asyncio.wait_for(r.done.wait(), VOTE_TIMEOUT)
        except asyncio.TimeoutError:
            missing = r.expected - set(r.votes)
            self._decide(r, {w: f"no answer within {VOTE_TIMEOUT:g} s" for w in missing})
        failures = r.failures
        assert failures is not None  # _decide sets it before it sets r.done
        return failures

    def _decide_if_complete(self, r: _Round) -> None:
        if r.failures is None and r.votes and r.expected <= set(r.votes):
            self._decide(r, {})

    def _decide(self, r: _Round, missing: dict[str, str]) -> None:
        assert self.scheduler is not None
        if r.failures is not None:
            return
        r.failures = {w: e for w, (e, _) in r.votes.items() if e} | missing
        plugins = self.scheduler.worker_plugins
        if not r.failures:
            if r.plugin is not None:
                self.committed[r.token] = r.plugin
            while len(self.committed) > self.KEEP:
                del self.committed[next(iter(self.committed))]
        elif r.plugin is not None and plugins.get(r.name) is r.plugin:  # not registered again
            previous = {p for _, p in r.votes.values() if p in self.committed}
            if previous:
                plugins[r.name] = self.committed[previous.pop()]
            else:
                plugins.pop(r.name, None)
        r.done.set()


async def register_on_every_worker(scheduler: Scheduler, plugin: Any) -> dict[str, str]:
    """Register the worker plugin ``plugin`` on every worker, from the scheduler; what
    ``client.register_plugin(RMMPlugin(...))`` runs (the plugin's ``start``).

    Does what distributed's own worker-plugin registration does (keep the plugin for workers
    that join later, send it to every worker and wait for each setup), except that a worker that
    dies or cannot be reached meanwhile is named instead of ending the registration with its
    comm error: the workers that set up keep their setup (the vote no longer waits for a worker
    that left), and the lost workers are returned, logged on the scheduler and published as an
    event on the ``dask-rmm`` topic (``client.get_events("dask-rmm")``). A failed setup raises
    what the workers raised (:class:`~dask_rmm.plugin.RMMSetupError`, naming every failure).
    """
    from distributed.core import clean_exception
    from distributed.protocol.pickle import dumps

    name = plugin.name
    pickled = dumps(plugin)
    scheduler.worker_plugins[name] = pickled
    answers = await scheduler.broadcast(
        msg={"op": "plugin-add", "plugin": pickled, "name": name}, on_error="return"
    )
    lost: dict[str, str] = {}
    for address, answer in sorted(answers.items()):
        if isinstance(answer, BaseException):
            lost[address] = f"{type(answer).__name__}: {answer}"
        elif isinstance(answer, dict) and answer.get("status") == "error":
            _, exc, tb = clean_exception(
                _received(answer["exception"]), _received(answer.get("traceback"))
            )
            assert exc is not None
            raise exc.with_traceback(tb)
    if lost:
        logger.warning(
            "dask-rmm: registered %s on the workers that answered; %d lost during the "
            "registration (they set up what the scheduler holds if they come back): %s",
            name,
            len(lost),
            "; ".join(f"{w}: {why}" for w, why in lost.items()),
        )
        scheduler.log_event(
            "dask-rmm", {"action": "registration-lost-workers", "plugin": name, "lost": lost}
        )
    return lost


def _received(value: Any) -> Any:
    """A field of a worker's answer as the scheduler's comm left it: still serialized (or, over
    inproc, wrapped for serialization)."""
    from distributed.protocol import Serialize, Serialized, deserialize

    if isinstance(value, Serialized):
        return deserialize(value.header, value.frames)
    return value.data if isinstance(value, Serialize) else value  # inproc: never serialized
