"""Progress reporting for long loops (tokenizing, training).

On a terminal: one live line, redrawn in place with `\\r`, with rate and ETA.
Otherwise (batch jobs, logs): a plain line at most every `interval` seconds (10 s),
and none at all for work that ends before the first one is due.
"""

import sys
import time
from typing import TextIO


def format_duration(seconds: float) -> str:
    """A short human duration: 42s, 3m05s, 2h03m, 1d04h."""
    seconds = max(0, int(round(seconds)))
    minutes, s = divmod(seconds, 60)
    hours, m = divmod(minutes, 60)
    days, h = divmod(hours, 24)
    if days:
        return f"{days}d{h:02d}h"
    if hours:
        return f"{hours}h{m:02d}m"
    if minutes:
        return f"{minutes}m{s:02d}s"
    return f"{s}s"


def format_count(n: float) -> str:
    """A short human count: 950, 12.3k, 4.56M, 7.89G."""
    for limit, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= limit:
            return f"{n / limit:.3g}{suffix}"
    return f"{n:.3g}" if isinstance(n, float) else str(n)


class Progress:
    """`update(n)` as work is done, `close()` at the end (or use it as a context manager)."""

    def __init__(self, total: float | None = None, desc: str = "", unit: str = "it", stream: TextIO | None = None,
                 interval: float | None = None) -> None:
        self.total, self.desc, self.unit = total, desc, unit
        self.stream = sys.stdout if stream is None else stream
        isatty = getattr(self.stream, "isatty", None)
        self.live = bool(isatty and isatty())
        self.interval = interval if interval is not None else (0.2 if self.live else 10.0)
        self.done = 0
        self.start = self.last_print = time.monotonic()
        self.printed = False
        self.closed = False

    def update(self, n: int = 1) -> None:
        self.done += n
        now = time.monotonic()
        if now - self.last_print >= self.interval:
            self._print(now)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.live or self.printed:
            self._print(time.monotonic(), final=True)

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def line(self, now: float | None = None, final: bool = False) -> str:
        elapsed = (time.monotonic() if now is None else now) - self.start
        rate = self.done / elapsed if elapsed > 0 else 0.0
        parts = [f"{self.desc}:" if self.desc else ""]
        if self.total:
            parts.append(f"{format_count(self.done)}/{format_count(self.total)} {self.unit} ({100 * self.done / self.total:.0f}%)")
        else:
            parts.append(f"{format_count(self.done)} {self.unit}")
        parts.append(f"{format_count(rate)} {self.unit}/s")
        if final:
            parts.append(f"in {format_duration(elapsed)}")
        elif self.total and rate > 0:
            parts.append(f"ETA {format_duration(max(0, self.total - self.done) / rate)}")
        return " ".join(p for p in parts if p)

    def _print(self, now: float, final: bool = False) -> None:
        text = self.line(now, final)
        if self.live:
            end = "\n" if final else ""
            self.stream.write(f"\r{text}\x1b[K{end}")  # \x1b[K clears what a longer previous line left
        else:
            self.stream.write(text + "\n")
        self.stream.flush()
        self.last_print = now
        self.printed = True
