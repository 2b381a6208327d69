"""The benchmarks' shared measuring: a peak read once it holds, medians of timed calls, rounds."""

import torch

from experiments.bench.measure import median_row, median_seconds, settled_peak_mb
from types import SimpleNamespace


def _peaks(*readings):
    """read_peak() giving these readings in turn, then the last for ever; and a step() counter."""
    readings, calls = list(readings), []
    return (lambda: readings.pop(0) if len(readings) > 1 else readings[0]), (lambda: calls.append(1)), calls


def test_the_peak_is_read_once_it_held_for_the_steps_asked():
    read, step, calls = _peaks(500, 540, 560, 561, 560, 561, 575)
    peak, made, held = settled_peak_mb(step, read, step_s=0.0, held=3)
    assert (peak, made, held) == (561, 5, True) and len(calls) == 5  # rose twice, then held (within 0.5%) three steps


def test_a_peak_still_growing_is_reported_as_such_after_the_most_steps():
    read, step, calls = _peaks(*range(100, 200))
    assert settled_peak_mb(step, read, step_s=0.0, most=5) == (105, 5, False)


def test_no_step_is_started_that_would_end_past_the_budget():
    read, step, calls = _peaks(100)
    assert settled_peak_mb(step, read, step_s=61.0, budget_s=60.0) == (100, 0, False)
    assert not calls


def test_the_median_time_is_of_the_calls_after_the_warm_ups():
    calls = []
    seconds = median_seconds(lambda: calls.append(1), 5, torch.device("cpu"), warmups=2)
    assert len(calls) == 7 and 0 <= seconds < 0.1


def test_the_median_round_is_the_middle_one_by_its_key():
    rows = [{"tokens_per_s": 3, "n": 0}, {"tokens_per_s": 1, "n": 1}, {"tokens_per_s": 2, "n": 2}]
    assert median_row(rows, "tokens_per_s")["n"] == 2


def test_median_seconds_is_the_middle_timing(monkeypatch):
    from experiments.bench import measure

    clock, durations = [0.0], iter([100.0, 5.0, 1.0, 3.0, 2.0, 4.0])  # one warm-up, then five timed calls
    monkeypatch.setattr(measure, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    step = lambda: clock.__setitem__(0, clock[0] + next(durations))  # noqa: E731
    assert measure.median_seconds(step, 5, torch.device("cpu"), warmups=1) == 3.0
