"""Start-up without the cyclic garbage collector (common/startup.py): off inside the block, back on after it
(also after an exception), a nested block leaves it to the outermost, a collector that was off stays off;
the function wrapper pickles by value as Ray pickles an actor's methods; and the suite's own tests run with
the collector on (tests/conftest.py turns it off only while collecting)."""

import gc

import pytest
import ray.cloudpickle

from common.startup import gc_paused, without_gc


def test_the_collector_is_off_inside_the_block_and_on_after_it():
    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the inner block leaves it to the outer one
    assert gc.isenabled()
    with pytest.raises(ValueError), gc_paused():
        raise ValueError("boom")
    assert gc.isenabled()


def test_a_collector_turned_off_before_stays_off():
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_wrapped_function_runs_without_the_collector_and_pickles_by_value():
    def load(x: int) -> tuple[int, bool]:
        return x + 1, gc.isenabled()

    wrapped = without_gc(load)
    assert wrapped(1) == (2, False) and gc.isenabled()
    assert wrapped.__name__ == "load" and wrapped.__wrapped__ is load
    assert ray.cloudpickle.loads(ray.cloudpickle.dumps(wrapped))(2) == (3, False)
