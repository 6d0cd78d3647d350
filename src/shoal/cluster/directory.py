"""The gateway's view of the workers, from their heartbeats: who is live, what each serves, and
which pool a call goes to.

    shoal.hb.<worker> ─on_heartbeat─▶ workers {id: (received, Heartbeat)}
        live()      heard from within worker_ttl_s and not draining (long silent ones forgotten)
        served()    model id -> [(heartbeat, its status of the model)] (rebuilt every 50 ms or more)
        holders()   the live workers serving a model; NoWorker (503) counts demand when none does
        pool_of()   the pool with the most free tokens among them (pool_for: cached per model)

Heartbeats travel on core NATS: the subscription comes back by itself after a reconnect, and a
gateway asks for every heartbeat (`shoal.ping`) when it (re)connects. Nothing is persisted.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import Any

import msgspec

from ..catalog import Catalog
from ..config import ClusterSettings
from ..errors import NoWorker, UnknownModel
from ..metrics import GatewayMetrics
from ..service import Capacity, CardProblem, ModelStatus, status_of_card
from . import protocol as p

log = logging.getLogger("shoal.gateway")

# The demand gauge counts unserved requests over this window.
_DEMAND_WINDOW_S = 60.0
# How long `served()` is reused before it is rebuilt from the heartbeats (every request asks): 50 ms,
# longer at thousands of workers (40 us per worker: a rebuild walks every worker, ~2 us each, and
# rebuilding every 50 ms would take a fifth of a gateway at 5,000), never over 0.5 s.
_SERVED_REUSE_S = 0.05
_SERVED_REUSE_PER_WORKER_S = 40e-6
_SERVED_REUSE_MAX_S = 0.5

Holders = list[tuple[p.Heartbeat, ModelStatus]]


class WorkerDirectory:
    """The live workers and what they serve (see the module docstring); the gateway's model
    statuses, problems and capacity come from here."""

    def __init__(self, cluster: ClusterSettings, catalog: Catalog, gm: GatewayMetrics) -> None:
        self.cluster = cluster
        self.catalog = catalog
        self.gm = gm
        self._workers: dict[str, tuple[float, p.Heartbeat]] = {}  # id -> (monotonic time received, heartbeat)
        self._demand: dict[str, collections.deque[float]] = {}
        self._served_cache: tuple[float, dict[str, Holders]] | None = None
        self._pools: dict[str, str] = {}  # model id -> pool_of its holders, while _served_cache stands
        self._served_reuse_s = _SERVED_REUSE_S

    async def on_heartbeat(self, msg: Any) -> None:
        try:
            beat = msgspec.msgpack.decode(msg.data, type=p.Heartbeat)
        except msgspec.DecodeError:
            log.warning("gateway: an undecodable heartbeat on %s", msg.subject)
            return
        previous = self._workers.get(beat.worker)
        now = time.monotonic()
        self._workers[beat.worker] = (now, beat)
        if (
            previous is None
            or previous[0] < now - self.cluster.worker_ttl_s  # back after the map left it out
            or previous[1].draining != beat.draining
            or _names(previous[1]) != _names(beat)
        ):
            # A worker came, came back, went or changed which models it serves: seen at once. A
            # change of their states (a load, an eviction) waits for the next rebuild (50 ms, up
            # to 0.5 s): at thousands of workers some heartbeat has one on every call, and each
            # rebuild walks every worker.
            self._served_cache = None

    def live(self) -> list[p.Heartbeat]:
        horizon = time.monotonic() - self.cluster.worker_ttl_s
        for worker, (seen, _) in list(self._workers.items()):
            if seen < horizon - 60.0:  # long gone: forget it
                del self._workers[worker]
        return [beat for seen, beat in self._workers.values() if seen >= horizon and not beat.draining]

    def served(self) -> dict[str, Holders]:
        """Model id -> the live workers serving it, with each one's status of the model (rebuilt at
        most every 50 ms, up to 0.5 s at thousands of workers, or on news from a worker: every
        request asks)."""
        now = time.monotonic()
        if self._served_cache is not None and now - self._served_cache[0] < self._served_reuse_s:
            return self._served_cache[1]
        served: dict[str, Holders] = {}
        for beat in self.live():
            for status in beat.models:
                served.setdefault(status.id, []).append((beat, status))
        self._served_cache = (now, served)
        self._pools = {}
        self._served_reuse_s = min(
            _SERVED_REUSE_MAX_S, max(_SERVED_REUSE_S, _SERVED_REUSE_PER_WORKER_S * len(self._workers))
        )
        return served

    def resolve(self, model_id: str, served: dict[str, Holders] | None = None) -> str:
        """The served or catalogued model `model_id` names (an id or an alias); else UnknownModel."""
        served = self.served() if served is None else served
        if model_id in served:
            return model_id
        for mid, holders in served.items():
            if any(model_id in status.aliases for _, status in holders):
                return mid
        return self.catalog.get(model_id).id  # UnknownModel (with suggestions) for a typo

    def holders(self, model_id: str) -> Holders:
        """The live workers serving the model; NoWorker (503, demand counted) when there are none."""
        holders = self.served().get(model_id)
        if not holders:
            self.gm.unserved.labels(model_id).inc()
            self.record_demand(model_id, add=True)
            raise NoWorker(
                f"no worker serves {model_id} right now; retry shortly (a pool that scaled to zero is "
                "being woken by this demand)",
                retry_after_s=max(2.0, self.cluster.worker_ttl_s),
                details={"model": model_id},
            )
        return holders

    def record_demand(self, model_id: str, *, add: bool) -> None:
        times = self._demand.setdefault(model_id, collections.deque())
        now = time.monotonic()
        if add:
            times.append(now)
        while times and times[0] < now - _DEMAND_WINDOW_S:
            times.popleft()
        self.gm.demand.labels(model_id).set(len(times))

    def pool_for(self, model_id: str) -> str:
        """The pool a call of the model goes to: `pool_of` its holders, worked out once per model
        while the served map stands (not per call: a model held by thousands of workers would cost
        every call a walk over them); NoWorker as `holders`."""
        holders = self.holders(model_id)
        pool = self._pools.get(model_id)
        if pool is None:
            pool = self._pools[model_id] = self.pool_of(holders)
        return pool

    @staticmethod
    def pool_of(holders: Holders) -> str:
        """The pool with the most free capacity among the model's workers (most have one pool)."""
        free: dict[str, int] = collections.defaultdict(int)
        for beat, _ in holders:
            free[beat.pool] += beat.free_tokens + 1
        return max(free, key=free.__getitem__)

    async def keep_gauges(self) -> None:
        """Keeps the gauges true every second: live workers per pool, demand over the last minute."""
        while True:
            await asyncio.sleep(1.0)
            pools = collections.Counter(beat.pool for beat in self.live())
            for pool in {beat.pool for _, beat in self._workers.values()} | set(pools):
                self.gm.workers.labels(pool).set(pools.get(pool, 0))
            for model_id in list(self._demand):
                self.record_demand(model_id, add=False)

    # --- the gateway's statuses -----------------------------------------------------------------

    def models(self) -> list[ModelStatus]:
        served = self.served()
        statuses = {mid: merge(holders) for mid, holders in served.items()}
        for card in self.catalog:
            if card.id not in statuses:
                statuses[card.id] = status_of_card(card, state="no_worker", aliases=self.catalog.aliases_of(card.id))
        return sorted(statuses.values(), key=lambda s: s.id)

    def model(self, model_id: str) -> ModelStatus:
        served = self.served()
        mid = self.resolve(model_id, served)
        if mid in served:
            return merge(served[mid])
        return status_of_card(self.catalog.get(mid), state="no_worker", aliases=self.catalog.aliases_of(mid))

    def has_model(self, model_id: str) -> bool:
        try:
            self.resolve(model_id)
        except UnknownModel:
            return False
        return True

    def problems(self) -> list[CardProblem]:
        seen = {problem.file: problem for beat in self.live() for problem in beat.problems}
        return sorted(seen.values(), key=lambda problem: problem.file)

    def capacity(self) -> Capacity:
        live = self.live()
        rates = [beat.tokens_per_s for beat in live if beat.tokens_per_s]
        return Capacity(
            sum(beat.inflight_tokens for beat in live),
            sum(beat.inflight_tokens + beat.free_tokens for beat in live),
            sum(rates) if rates else None,
        )


def merge(holders: list[tuple[Any, ModelStatus]]) -> ModelStatus:
    """One status of a model from its workers': loaded if any has it loaded (then that one's)."""
    statuses = [status for _, status in holders]
    order = {"loaded": 0, "loading": 1, "not_loaded": 2, "failed": 3}
    best = min(statuses, key=lambda s: order.get(s.state, 4))
    adapters_loaded = tuple(sorted({a for s in statuses for a in s.adapters_loaded}))
    return msgspec.structs.replace(best, adapters_loaded=adapters_loaded, pinned=any(s.pinned for s in statuses))


def _names(beat: p.Heartbeat) -> list[tuple[str, tuple[str, ...]]]:
    """The models a heartbeat says its worker serves, by the names a request may use."""
    return [(status.id, status.aliases) for status in beat.models]
