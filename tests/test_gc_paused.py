"""rungs.gc_paused: the cyclic collector is off inside (torch.export's trace), on again after, also
when the export raises, and the trace's cycles are collected on the way out."""

import gc
import weakref

import pytest

from normexport.exporter.rungs import gc_paused


class _Node:
    pass


def _cycle():
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def test_collector_off_inside_and_cycles_freed_after():
    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
        ref = _cycle()
        assert ref() is not None  # nothing collects it while paused
    assert gc.isenabled()
    assert ref() is None  # the collection on exit freed it


def test_collector_back_on_when_the_export_raises():
    with pytest.raises(RuntimeError):
        with gc_paused():
            raise RuntimeError("export failed")
    assert gc.isenabled()


def test_a_disabled_collector_stays_disabled():
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_the_exit_collects_the_youngest_generation_alone():
    """With the collector off nothing is promoted: the youngest generation holds everything the trace made, and
    collecting it alone frees the trace's cycles without walking the process's older objects (a full collection
    after every export cost a test run 500 of its 3,900 CPU seconds). Planted: gc.collect() -> [2]."""
    generations = []

    def seen(phase, info):
        if phase == "start":
            generations.append(info["generation"])

    gc.callbacks.append(seen)
    try:
        with gc_paused():
            ref = _cycle()
    finally:
        gc.callbacks.remove(seen)
    assert generations == [0] and ref() is None, generations
