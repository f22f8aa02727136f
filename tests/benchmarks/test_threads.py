"""The benchmark's per-thread CPU split: work in a thread named like the federation's background sum counts there."""

import threading
import time

import pytest

from benchmarks.harness.threads import ThreadClock


def _burn(seconds: float) -> None:
    end = time.thread_time() + seconds
    x = 0
    while time.thread_time() < end:
        x += 1


@pytest.mark.skipif(not ThreadClock().available, reason="per-thread CPU counters are Linux-only")
def test_background_thread_cpu_is_counted_apart_from_the_training_thread() -> None:
    clock = ThreadClock()
    clock.start()
    burnt, release = threading.Event(), threading.Event()

    def work() -> None:
        _burn(0.3)
        burnt.set()
        release.wait(30)  # the thread's counters vanish with it: it stays until its last CPU second was sampled

    worker = threading.Thread(target=work, name="fedshard-outer_0")
    worker.start()
    while not burnt.is_set():
        clock.sample()  # sampled while it runs, as the recorder does per step
        time.sleep(0.02)
    clock.sample()
    release.set()
    worker.join()
    _burn(0.2)
    clock.sample()
    seconds = clock.seconds()
    assert seconds["background_sum"] >= 0.2
    assert seconds["training"] >= 0.15
    assert seconds["background_sum"] + seconds["training"] + seconds["other"] <= 1.0
