"""A resumed run's wait for its model server, before its first request.

After a crash the machine may be rebooting, and the server come up before its model server
does. A task a dead process left is then not failed for a model not there yet (its client is not
there to send it again): its run waits, the task as it was, asking the server's catalog again
less and less often, until the server answers or says no in a way that waiting would not change.
A new task's run does not wait: its client is there, and is told at once.
"""

from __future__ import annotations

import logging
from typing import Protocol

import attrs
import trio

from runtime.models import ModelError

logger = logging.getLogger(__name__)

# The catalog is asked again after 1 s, then twice as long each time, at most 30 s apart.
WAIT_FIRST_S = 1.0
WAIT_MAX_S = 30.0


class Catalog(Protocol):
    """What the wait needs of a model client (runtime.models.ModelClient is one)."""

    async def has_model(self, name: str | None = None) -> bool: ...


@attrs.define(eq=False)
class ModelWait:
    """Waits, for a resumed run, until the model server can be reached (``until_reachable``).

    One per runner: the runs that wait at once (every task a dead process left, after a reboot)
    are said in one line as the first begins to wait, and in one as the server shuts down, not in
    a line each; each says when it resumes."""

    catalog: Catalog  # asked once each time, without retries of its own
    stopping: trio.Event  # set when the server begins to shut down
    endpoint: str = ""  # where the model is served, for the log (no credentials)
    _waiting: int = attrs.field(init=False, default=0)  # runs waiting now
    _stop_said: bool = attrs.field(init=False, default=False)

    @property
    def waiting(self) -> int:
        """How many runs wait for the model server now."""
        return self._waiting

    async def until_reachable(self, task_id: str) -> bool:
        """Block until the model server answers its catalog, or fails in a way another try would
        not change (a refused key, say: the run's request fails with it). False, at once, if the
        server begins to shut down while the model cannot be reached. Cancellation ends the wait."""
        delay_s = 0.0
        began = trio.current_time()
        try:
            while (unreachable := await self._unreachable()) is not None:
                if not delay_s:
                    self._waiting += 1
                    if self._waiting == 1:  # the first to wait says it; those that come while it waits, with it
                        where = f" at {self.endpoint}" if self.endpoint else ""
                        said = f"; it said: {unreachable.detail}" if unreachable.detail else ""
                        logger.warning(
                            "task %s waits for the model server%s to be reachable to resume: %s%s (other tasks left"
                            " running that find it so meanwhile wait with it, unsaid)", task_id, where, unreachable.reason, said,
                        )  # fmt: skip
                delay_s = min(max(2 * delay_s, WAIT_FIRST_S), WAIT_MAX_S)
                with trio.move_on_after(delay_s):
                    await self.stopping.wait()
                if self.stopping.is_set():
                    if not self._stop_said:  # every run waiting wakes now: one line for them all
                        self._stop_said = True
                        if self._waiting > 1:
                            logger.warning(
                                "shutting down: task %s and %d other task(s) waiting for the model server to resume are"
                                " canceled", task_id, self._waiting - 1,
                            )  # fmt: skip
                        else:
                            logger.warning("shutting down: task %s, waiting for the model server to resume, is canceled", task_id)
                    return False
        finally:
            if delay_s:
                self._waiting -= 1
        if delay_s:
            logger.info("task %s resumes: the model server is reachable after %.0f s", task_id, trio.current_time() - began)
        return True

    async def _unreachable(self) -> ModelError | None:
        try:
            await self.catalog.has_model()
        except ModelError as exc:
            return exc if exc.retryable else None
        return None
