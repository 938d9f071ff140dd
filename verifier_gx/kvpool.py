"""Per-session target KV, bounded: at most `limits.kv_sessions` sessions keep their KV.

Each session gets its own `TargetExecutor` over its own sequence of the backend
(`MultiSequenceBackend.sequence()`), so switching between sessions costs no prefill. When a
new session would exceed the cap, the least recently used session's KV is dropped; its next
round re-evaluates its committed transcript (the same path a restarted verifier takes). A
decision is the target's rows judged exactly, so eviction changes timing and, at most, the
last float bits of those rows: a transcript evaluated in one prefill gives rows about 3e-6
from the same one evaluated round by round (float32 sums in another order), as a batched
forward does against a lone one. Only a near-tie of greedy argmax could tell them apart.

A backend without per-sequence KV (vLLM, the test fakes) gives every session a cursor over
its one shared KV: correct, and re-evaluated whenever sessions interleave.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable

from muser.backend import ModelBackend, batches
from verifier_gx.executor import TargetExecutor
from verifier_gx.journal import short

log = logging.getLogger("muser.verifier")


class KvPool:
    def __init__(
        self, backend: ModelBackend, capacity: int, on_evict: Callable[[], None] | None = None
    ) -> None:
        if capacity < 1:
            raise ValueError(f"a KV pool holds at least one session, got capacity {capacity}")
        self.backend, self.capacity = backend, capacity
        self.per_session = batches(backend)
        """True: each session has its own KV; False: sessions share the backend's one KV."""
        self.evictions = 0
        self.on_evict = on_evict
        self._held: OrderedDict[bytes, TargetExecutor] = OrderedDict()
        self._lock = threading.Lock()  # the compute thread takes, the event loop drops

    def holding(self, session_id: bytes) -> TargetExecutor | None:
        """The session's executor when its KV is held; None otherwise (nothing evicted, the
        recency order unchanged)."""
        with self._lock:
            return self._held.get(session_id)

    def executor(self, session_id: bytes) -> TargetExecutor:
        """The session's executor, now the most recently used; evicts the least recently
        used beyond the cap (call for every session of a batch before computing it: a batch
        is never larger than the cap, so it never evicts one of its own)."""
        with self._lock:
            ex = self._held.pop(session_id, None)
            if ex is None:
                ex = TargetExecutor(self.backend.sequence() if self.per_session else self.backend)
            self._held[session_id] = ex
            while len(self._held) > self.capacity:
                old, _ = self._held.popitem(last=False)
                self.evictions += 1
                if self.on_evict is not None:
                    self.on_evict()
                log.info("session %s: target KV evicted (limits.kv_sessions %d)", short(old),
                         self.capacity)  # fmt: skip
            return ex

    def drop(self, session_id: bytes) -> None:
        """Forget a session's KV (closed or finished)."""
        with self._lock:
            self._held.pop(session_id, None)

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._held

    def __len__(self) -> int:
        return len(self._held)

    def held(self) -> list[bytes]:
        """Session ids holding KV, least recently used first."""
        with self._lock:
            return list(self._held)
