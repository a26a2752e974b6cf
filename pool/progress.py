"""Progress of a long run of programs: a live bar on a terminal, plain lines otherwise."""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 60}:{seconds % 60:02d}"


class ProgressDisplay:
    """Counts outcomes and shows them: one redrawn line on a TTY, a line per program otherwise."""

    def __init__(self, total: int, stream: TextIO | None = None, live: bool | None = None) -> None:
        self.total = total
        self.stream = stream if stream is not None else sys.stderr
        self.live = self.stream.isatty() if live is None else live
        self.counts: dict[str, int] = {}
        self.done = 0
        self.started = time.monotonic()
        # Programs finish on several threads (pool callbacks, lowering): one
        # line at a time, or lines interleave.
        self._lock = threading.Lock()

    def update(self, name: str, outcome: str, seconds: float, detail: str = "") -> None:
        """Records one finished program and redraws (or prints its line); thread-safe."""
        with self._lock:
            self._update(name, outcome, seconds, detail)

    def _update(self, name: str, outcome: str, seconds: float, detail: str) -> None:
        self.done += 1
        self.counts[outcome] = self.counts.get(outcome, 0) + 1
        if self.live:
            self._draw()
            return
        line = f"[{self.done}/{self.total}] {outcome:<14} {name} ({seconds:.2f} s)"
        if detail:
            line += f": {detail.splitlines()[0][:200]}"
        # One write per line: other writers (warnings) cannot split it.
        self.stream.write(line + "\n")
        self.stream.flush()

    def _draw(self) -> None:
        width = 24
        filled = width * self.done // max(self.total, 1)
        elapsed = time.monotonic() - self.started
        eta = elapsed / self.done * (self.total - self.done) if self.done else 0.0
        counts = ", ".join(f"{n} {outcome}" for outcome, n in sorted(self.counts.items()))
        text = (
            f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total}  {counts}"
            f"  elapsed {_clock(elapsed)}  ETA {_clock(eta)}\x1b[K"
        )
        self.stream.write(text)
        self.stream.flush()

    def close(self) -> None:
        """Ends the live line."""
        with self._lock:
            if self.live and self.done:
                self.stream.write("\n")
                self.stream.flush()
