from oracles import admission_cap

from replay_buffer.staleness import is_usable, staleness


def test_staleness_rule():
    assert staleness(5, 3) == 2
    assert is_usable(5, 4, 1) and not is_usable(5, 3, 1)
    assert is_usable(5, 5, 0) and not is_usable(5, 4, 0)


def test_admission_cap():
    assert admission_cap(version=0, max_staleness=0, groups_per_step=16) == 16
    assert admission_cap(version=3, max_staleness=2, groups_per_step=4) == 24
