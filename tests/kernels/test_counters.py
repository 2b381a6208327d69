"""kernels/counters.py: launches are recorded only inside recording(), and a nested block's reach
the outer one too."""

from kernels.counters import Launch, counting, record, recording


def test_launches_are_recorded_only_inside_recording_and_nested_ones_reach_the_outer():
    first, second = Launch("first", (1,), rows=16, keys=0), Launch("second", (2,), rows=16, keys=0)
    record(first)
    assert not counting()
    with recording() as outer:
        record(first)
        with recording() as inner:
            record(second)
    assert inner == [second] and outer == [first, second]
    assert not counting()
