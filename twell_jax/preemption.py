"""Stop requests from signals: SIGTERM (a scheduler's preemption) and SIGINT (Ctrl-C) are
recorded instead of interrupting, and a training loop acts on them at a step boundary.

    with StopSignals() as signals:
        for step in ...:
            ...one step...
            signum = signals.agreed()
            if signum:
                ...save a checkpoint...
                raise SystemExit(exit_status(signum))

Why record instead of raising: an exception raised inside a step or inside a checkpoint write
leaves half-written state behind. While the handlers are installed every further signal is
recorded too, so a second Ctrl-C during the final save cannot interrupt it (SIGKILL cannot be
caught; Orbax's write-to-a-temporary-folder-then-rename keeps the previous checkpoint intact).
"""

from __future__ import annotations

import os
import signal
import threading

import jax
import numpy as np

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def exit_status(signum: int) -> int:
    """The shell's status of a process killed by ``signum``: 128 + the signal's number (143 for
    SIGTERM, 130 for SIGINT), so schedulers and shells read the stop as that signal's."""
    return 128 + int(signum)


class StopSignals:
    """While entered (on the main thread), SIGTERM and SIGINT only append their number to
    ``received``; the previous handlers come back on exit. A signal ignored on entry stays
    ignored: a shell without job control starts its background jobs with SIGINT ignored, so
    that a Ctrl-C meant for the foreground does not stop them."""

    def __init__(self, signals: tuple[int, ...] = STOP_SIGNALS):
        self.signals = signals
        self.received: list[int] = []
        self._previous: dict[int, object] = {}
        self._pipe: tuple[int, int] | None = None
        self._previous_wakeup_fd = -1

    def __enter__(self) -> "StopSignals":
        # Python installs signal handlers only from the main thread; elsewhere (a test driving
        # the loop from a worker thread) the default behaviour stays.
        if threading.current_thread() is threading.main_thread():
            # Python runs the handlers of signals that arrived together in the order of their
            # numbers, not of their arrival: a SIGTERM followed 10 ms later by a SIGINT, both
            # pending while a step runs in XLA, would be read as a SIGINT. Its C-level handler
            # writes each signal's number to the wakeup fd as it arrives, so the pipe holds the
            # arrival order.
            self._pipe = os.pipe()
            for fd in self._pipe:
                os.set_blocking(fd, False)
            self._previous_wakeup_fd = signal.set_wakeup_fd(self._pipe[1],
                                                            warn_on_full_buffer=False)
            for signum in self.signals:
                if signal.getsignal(signum) is not signal.SIG_IGN:
                    self._previous[signum] = signal.signal(signum, self._record)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
        if self._pipe is not None:
            signal.set_wakeup_fd(self._previous_wakeup_fd)
            for fd in self._pipe:
                os.close(fd)
            self._pipe = None

    def _arrived(self) -> list[int]:
        """The signal numbers written to the wakeup pipe since the last call, in arrival order."""
        if self._pipe is None:
            return []
        data = b""
        while True:
            try:
                chunk = os.read(self._pipe[0], 512)
            except BlockingIOError:
                break
            if not chunk:
                break
            data += chunk
        return [n for n in data if n in self.signals]

    def _record(self, signum: int, frame) -> None:
        # Every pending signal is in the pipe before the first handler runs, in arrival order;
        # the later handlers of the same batch find it empty and add their own signal after.
        self.received.extend(self._arrived() or [signum])

    def agreed(self) -> int | None:
        """The signal every process stops for, or None to go on.

        One process: the first signal received here. Several (``jax.process_count() > 1``):
        the processes exchange their first signal (0 for none) in a tiny all-gather and all
        take the largest, so every process stops after the same step and takes part in the
        same checkpoint save (each writes its own shards). Every process must call this at
        the same step boundaries.
        """
        local = self.received[0] if self.received else 0
        if jax.process_count() == 1:
            return local or None
        from jax.experimental import multihost_utils

        everyone = multihost_utils.process_allgather(np.int32(local))
        return int(np.max(everyone)) or None
