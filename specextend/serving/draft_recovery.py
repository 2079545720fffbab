"""The replica's draft recovery (docs/architecture.md, "Deployment"): a session that fell back marks
the draft failed at once (`/health` reads "restoring", new requests go to the AR engine), and the
replica waits for the draft actor (through a Ray restart) or starts a new one, then reconnects.
A mixin of serving/replica.SpecExtendReplica, whose fields it reads: draft, draft_actor, draft_ok,
draft_epoch, engine, _restoring, _start_draft_actor."""

from __future__ import annotations

import asyncio
import logging

import ray
from ray.exceptions import ActorUnavailableError, TaskCancelledError

log = logging.getLogger(__name__)

DRAFT_START_TIMEOUT_S = 600.0  # loading a draft model (real models on a slow disk take minutes)


class DraftRecovery:
    def _blame_draft(self, stats, engine, epoch: int) -> None:
        """A session fell back: its draft failed, unless it was served plainly (`engine`) or began
        before the last restore (`epoch`), which says nothing new."""
        if stats.fallback and engine is self.engine and epoch == self.draft_epoch:
            self._draft_failed()

    def _draft_failed(self) -> None:
        if self.draft is None or self._restoring is not None:
            return
        self.draft_ok = False
        self._restoring = asyncio.get_running_loop().create_task(self._restore_draft())

    async def _restore_draft(self) -> None:
        """Waits for the draft actor (restarted by Ray, or a new one) and reconnects to it. A draft in
        the replica's process has nothing to restart: alive, it serves again; its thread dead, the
        replica decodes plainly from then on."""
        delay = 0.5
        try:
            if self.draft_actor is None:
                if await asyncio.to_thread(self.draft.health):
                    self.draft_epoch += 1
                    self.draft_ok = True
                else:
                    log.error("the draft's worker in this replica has stopped: plain decoding from now on")
                return
            while True:
                try:
                    address = await asyncio.wait_for(self.draft_actor.address.remote(), DRAFT_START_TIMEOUT_S)
                except (ActorUnavailableError, TaskCancelledError):  # Ray is restarting it (max_restarts), or
                    # this call met the kill that restarts it (cancelled, not dead: the next one tells): wait
                    await asyncio.sleep(delay)
                    delay = min(2 * delay, 10.0)
                    continue
                except Exception as e:  # noqa: BLE001 - dead for good, or not coming back in time
                    log.warning("draft actor unavailable (%s); starting a new one", type(e).__name__)
                    ray.kill(self.draft_actor, no_restart=True)
                    self.draft_actor = self._start_draft_actor()
                    continue
                if address != self.draft.address:
                    self.draft.reconnect(address)
                if await asyncio.to_thread(self.draft.health):
                    log.info("draft restored at %s", address)
                    self.draft_actor.warmed.remote()  # a restored draft met only its own warm-up
                    self.draft_epoch += 1
                    self.draft_ok = True
                    return
                await asyncio.sleep(delay)
                delay = min(2 * delay, 10.0)
        finally:
            self._restoring = None

    async def check_health(self) -> None:
        """Serve's periodic health check: notices a dead idle draft."""
        if self.draft is not None and self.draft_ok and not await asyncio.to_thread(self.draft.health):
            self._draft_failed()
