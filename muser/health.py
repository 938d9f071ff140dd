"""What a daemon's health check answers: SERVING unless a fault stands.

A fault is a component that cannot do its part, with the reason an operator reads:

    wal      the daemon's log refuses appends (a write or an fsync failed)
    target   the verifier's target backend raised on its last forward
    draft    the proposer's draft backend raised on its last draft

While any stands the standard gRPC health check answers NOT_SERVING (for the whole server
and its service), `muser status` exits non-zero naming each fault, and /metrics carries
`muser_serving 0` and `muser_fault{component, reason}`. A backend fault clears on the next
forward that succeeds; a wal fault clears when the log is reopened (the proposer does that
itself once its directory takes writes again; the verifier is restarted by its operator,
see `verifier_gx.daemon`).

`Health.fault` may be called from any thread (the WAL reports from its writer or fsync
thread, a backend from the worker running it): the health servicer is updated on the loop
that `start` ran on.
"""

from __future__ import annotations

import asyncio
import logging
import threading

from grpc_health.v1 import health, health_pb2

from muser.errors import MuserError
from muser.tasks import in_background

log = logging.getLogger("muser.health")

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def backend_failure(results) -> BaseException | None:
    """The first of a batch's results that is the backend's failure: an exception other
    than a MuserError (which names what its own request did wrong); None when none is."""
    return next(
        (r for r in results if isinstance(r, Exception) and not isinstance(r, MuserError)), None
    )


class Health:
    def __init__(self, service: str) -> None:
        self.faults: dict[str, str] = {}
        """Component -> reason; the daemon's stats share this dict (DaemonStats.faults), so
        its Status and /metrics read the same faults."""
        self.services = ("", service)
        self.servicer = health.aio.HealthServicer()
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def serving(self) -> bool:
        return not self.faults

    def reason(self, component: str) -> str | None:
        return self.faults.get(component)

    async def start(self) -> None:
        """Answer health checks from now on (SERVING unless a fault already stands)."""
        self._loop = asyncio.get_running_loop()
        await self._publish()

    async def stop(self) -> None:
        self._loop = None
        await self.servicer.enter_graceful_shutdown()

    def fault(self, component: str, reason: str | None) -> None:
        """`component` cannot do its part because of `reason` (None: it can again)."""
        with self._lock:
            before = self.faults.get(component)
            if reason == before:
                return
            if reason is None:
                del self.faults[component]
            else:
                self.faults[component] = reason
        if reason is None:
            log.warning(
                "%s recovered; %s", component, "SERVING" if self.serving else "still NOT_SERVING"
            )
        else:
            log.error("%s failed, reporting NOT_SERVING: %s", component, reason)
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(
                lambda: in_background(self._publish(), "a health update", log)
            )

    async def _publish(self) -> None:
        """The servicer answers what the faults say now (read here, so that updates
        scheduled out of order still end at the latest state)."""
        status = SERVING if self.serving else NOT_SERVING
        for name in self.services:
            await self.servicer.set(name, status)
