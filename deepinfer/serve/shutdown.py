"""Graceful shutdown that tells the clients.

On SIGINT/SIGTERM uvicorn leaves its main loop and calls ``shutdown``. Before it closes
anything, this server: marks the state draining (new generation requests get 503 at
once), gives the sequences in flight up to ``--shutdown-timeout`` seconds to finish,
then stops the engine loop, which fails what is left with "the server is shutting
down": each remaining stream writes an OpenAI-shaped error event and ``[DONE]``, and a
non-streaming request gets its error body. Only then does uvicorn close the
connections, so no stream is cut without an end. (uvicorn's own graceful timeout would
cancel the handlers first, and a cancelled stream just stops.)
"""

from __future__ import annotations

import asyncio
import logging
import time

import uvicorn

log = logging.getLogger("deepinfer.serve")

# after the engine has failed the stragglers: time for their handlers to write the end
FLUSH_S = 5.0


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state, shutdown_timeout: float):
        super().__init__(config)
        self.deepinfer = state
        self.shutdown_timeout = shutdown_timeout

    async def shutdown(self, sockets=None) -> None:
        state, engine = self.deepinfer, self.deepinfer.engine
        state.draining = True
        deadline = time.monotonic() + self.shutdown_timeout
        if engine.in_system:
            log.info("shutting down: %d sequence(s) in flight get up to %.1f s to finish",
                     engine.in_system, self.shutdown_timeout)
        while engine.in_system and time.monotonic() < deadline and not self.force_exit:
            await asyncio.sleep(0.05)
        if engine.in_system:
            log.warning("shutdown timeout: ending %d sequence(s) with an error", engine.in_system)
            await asyncio.to_thread(engine.stop)  # each stream gets its error event, then [DONE]
            flush_end = time.monotonic() + FLUSH_S
            while engine.in_system and time.monotonic() < flush_end:
                await asyncio.sleep(0.05)
        await super().shutdown(sockets)
