"""ProgressLines, the log lines of training, the offline evaluation and evaluate_vllm's agreement
check (README: "every long stage logs done/total, its rate and an ETA at least every 30 s"), at
its real interval, on a clock the test moves. The lines of real runs: test_workflow."""

import logging

from eaglenest.workflow.progress import PROGRESS_EVERY_S, ProgressLines


class Clock:
    """Seconds that pass only when the test says so."""

    def __init__(self, now=1000.0):
        self.now = now

    def __call__(self):
        return self.now


def lines(caplog):
    return [record.getMessage() for record in caplog.records]


def test_a_line_at_the_start_at_the_first_step_30_s_after_the_last_line_and_at_the_end(caplog):
    assert PROGRESS_EVERY_S == 30.0  # what README promises
    caplog.set_level(logging.INFO)
    clock = Clock()
    ticker = ProgressLines("training", 100, "steps", logger=logging.getLogger("progress"), clock=clock)
    assert lines(caplog) == ["training: 0/100 steps, 0.00 steps/s, elapsed 0.0 s, ETA ?"]
    logged_at = []
    for step in range(1, 13):  # a step every 7.5 s: 30 s after the start at step 4, 30 s after that at step 8
        clock.now += 7.5
        before = len(caplog.records)
        ticker.advance()
        if len(caplog.records) > before:
            logged_at.append(step)
    assert logged_at == [4, 8, 12]
    assert lines(caplog)[1:] == [
        "training: 4/100 steps, 0.13 steps/s, elapsed 30.0 s, ETA 0:12:00",
        "training: 8/100 steps, 0.13 steps/s, elapsed 0:01:00, ETA 0:11:30",
        "training: 12/100 steps, 0.13 steps/s, elapsed 0:01:30, ETA 0:11:00",
    ]
    clock.now += PROGRESS_EVERY_S - 0.5  # not yet 30 s: no line
    ticker.advance()
    assert len(caplog.records) == 4
    clock.now += 0.5  # 30 s since the last line: the next step reports
    ticker.advance()
    assert lines(caplog)[-1] == "training: 14/100 steps, 0.12 steps/s, elapsed 0:02:00, ETA 0:12:17"
    clock.now += 1
    ticker.advance(86)  # the last step reports at once
    assert lines(caplog)[-1] == "training: 100/100 steps, 0.83 steps/s, elapsed 0:02:01, ETA 0.0 s"
    assert len(caplog.records) == 6


def test_a_resumed_run_counts_its_earlier_steps_in_done_but_not_in_the_rate_and_shows_a_second_rate(caplog):
    caplog.set_level(logging.INFO)
    clock = Clock()
    ticker = ProgressLines("training", 100, "steps", logger=logging.getLogger("progress"), rate_of="supervised tokens",
                           done=40, clock=clock)
    clock.now += 30
    ticker.advance(10, work=5_000)
    assert lines(caplog) == [
        "training: 40/100 steps, 0.00 steps/s, 0 supervised tokens/s, elapsed 0.0 s, ETA ?",
        "training: 50/100 steps, 0.33 steps/s, 167 supervised tokens/s, elapsed 30.0 s, ETA 0:02:30",
    ]
