"""cpuosd.diagnose: SIGUSR2 writes every asyncio task's stack to stderr (SIGUSR1, every
thread's, is faulthandler's own)."""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import os
import signal
from collections.abc import AsyncIterator

import pytest

from cpuosd import diagnose


def test_sigusr2_writes_every_task_with_where_it_waits(capfd: pytest.CaptureFixture[str]
                                                       ) -> None:
    previous = signal.getsignal(signal.SIGUSR2)
    diagnose.install()
    try:
        @contextlib.asynccontextmanager
        async def lifespan(started: asyncio.Event) -> AsyncIterator[None]:
            try:
                yield
            finally:  # (a stop that waits in a lifespan's exit)
                started.set()
                await asyncio.Event().wait()

        async def stuck_in_here(started: asyncio.Event) -> None:
            async with lifespan(started):
                pass

        async def main() -> str:
            started = asyncio.Event()
            t = asyncio.create_task(stuck_in_here(started), name="the-stuck-one")
            await started.wait()  # (suspended in stuck_in_here from here on)
            # (CPython runs a signal's Python handler before os.kill returns to its caller
            # when the signal is the calling process's own)
            os.kill(os.getpid(), signal.SIGUSR2)
            err = capfd.readouterr().err
            t.cancel()
            return err

        err = asyncio.run(main())
    finally:
        faulthandler.unregister(signal.SIGUSR1)
        signal.signal(signal.SIGUSR2, previous)
    assert "--- cpuosd asyncio tasks at" in err and "--- end of tasks ---" in err, err
    assert "the-stuck-one" in err and "stuck_in_here" in err, err
    # through the async generator of the context manager's exit, to the await in it
    chain = err.split("the-stuck-one:")[1].split("--- end of tasks ---")[0]
    assert "in __aexit__" in chain and "in lifespan" in chain and "in wait" in chain, err
