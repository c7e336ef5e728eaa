"""Work that runs beside the caller's (a stdin pump beside an output reader, a terminal's
reader beside the caller): an asyncio task in the async SDK, a thread in the sync one
(``scripts/gen_sync.py`` swaps the names)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable


class AsyncBeside:
    """``fn()`` running as a task; ``join`` waits for it and raises what it raised."""

    def __init__(self, fn: Callable[[], Awaitable[None]]) -> None:
        async def run() -> None:
            await fn()

        self._task = asyncio.get_running_loop().create_task(run())

    def done(self) -> bool:
        return self._task.done()

    async def join(self) -> None:
        await self._task

    async def cancel(self) -> None:
        self._task.cancel()
        try:
            await self._task
        except BaseException:  # cancelled or failed: either way it is over
            pass


class Beside:
    """``fn()`` running in a daemon thread; ``join`` waits for it and raises what it
    raised. ``cancel`` cannot stop a thread: it waits a little and lets it go."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self._error: BaseException | None = None

        def run() -> None:
            try:
                fn()
            except BaseException as e:  # handed to join
                self._error = e

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def done(self) -> bool:
        return not self._thread.is_alive()

    def join(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise self._error

    def cancel(self) -> None:
        self._thread.join(0.5)
