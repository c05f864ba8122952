"""Progress of a long loop as rule-log lines, `label: done/total unit, rate/s, ETA`: at the start,
whenever PROGRESS_EVERY_S seconds passed since the last line, and at the end. A person watching
a rule's log of a stage that runs for hours sees it move at least that often. (vLLM generation
has its own, eaglenest.engine.generate.ProgressLog, because it must report between engine steps.)"""

import logging
import time

from eaglenest.workflow.units import duration

PROGRESS_EVERY_S = 30.0


class ProgressLines:
    """Call advance(n) as work is done; lines go to `logger`. `rate_of`: an optional second
    count per line (e.g. tokens), given to advance as `work=`, whose rate is shown too. `done`:
    what an earlier, resumed run did (counted in done/total, not in the rate). `clock`: seconds,
    monotonic (a test gives its own, to hold the interval without waiting for it)."""

    def __init__(self, label, total, unit, *, logger, rate_of=None, done=0, clock=time.monotonic):
        self.label, self.total, self.unit, self.logger = label, total, unit, logger
        self.rate_of, self.clock = rate_of, clock
        self.done = self.first = done
        self.work = 0
        self.start = self.last = clock()
        self.report()

    def advance(self, n=1, *, work=0):
        self.done += n
        self.work += work
        now = self.clock()
        if now - self.last >= PROGRESS_EVERY_S or self.done >= self.total:
            self.report(now)

    def report(self, now=None):
        now = self.clock() if now is None else now
        self.last, elapsed = now, max(now - self.start, 1e-9)
        rate = (self.done - self.first) / elapsed
        eta = duration((self.total - self.done) / rate) if rate else "?"
        extra = f", {self.work / elapsed:,.0f} {self.rate_of}/s" if self.rate_of else ""
        self.logger.log(logging.INFO, "%s: %d/%d %s, %.2f %s/s%s, elapsed %s, ETA %s", self.label, self.done,
                        self.total, self.unit, rate, self.unit, extra, duration(elapsed), eta)
