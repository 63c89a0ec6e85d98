import os
import signal

import pytest

from unbroken.preemption import DEFAULT_SIGNALS, EXIT_CODE, Preemption


def test_a_signal_only_sets_the_flag_and_handlers_are_restored():
    before = {s: signal.getsignal(s) for s in DEFAULT_SIGNALS}
    with Preemption() as preemption:
        assert not preemption.requested
        os.kill(os.getpid(), signal.SIGUSR1)
        assert preemption.requested and preemption.received == signal.SIGUSR1
        assert preemption.seconds_since_signal() >= 0
        os.kill(os.getpid(), signal.SIGTERM)  # a second signal keeps the first
        assert preemption.received == signal.SIGUSR1
    assert {s: signal.getsignal(s) for s in DEFAULT_SIGNALS} == before  # every one, the first too
    assert EXIT_CODE == 75


def test_signals_are_configurable():
    with Preemption(signals=[signal.SIGINT]) as preemption:
        os.kill(os.getpid(), signal.SIGINT)
        assert preemption.received == signal.SIGINT


def test_installing_from_another_thread_is_a_clear_error():
    import threading

    errors = []

    def run():
        try:
            with Preemption():
                pass
        except RuntimeError as error:
            errors.append(str(error))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert errors and "main thread" in errors[0]


def test_unknown_signal_numbers_are_refused():
    with pytest.raises(ValueError):
        Preemption(signals=[12345])


def test_nothing_is_requested_before_a_signal():
    assert not Preemption().requested and not Preemption(signals=()).requested
    assert Preemption().seconds_since_signal() == 0.0


def test_seconds_since_signal_counts_from_the_signal():
    import time

    with Preemption() as preemption:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        assert 0.05 <= preemption.seconds_since_signal() < 60


def test_installing_twice_still_puts_back_the_original_handler():
    original = signal.getsignal(signal.SIGUSR1)
    preemption = Preemption()
    preemption.install()
    preemption.install()  # a no-op: it must not record its own handler as "the previous one"
    preemption.uninstall()
    assert signal.getsignal(signal.SIGUSR1) is original


def test_workers_ignore_exactly_the_signals_of_installed_preemptions():
    from unbroken.preemption import active_signals

    assert signal.SIGINT not in active_signals()
    with Preemption(signals=[signal.SIGINT]):
        assert signal.SIGINT in active_signals()
        Preemption(signals=[signal.SIGINT]).uninstall()  # never installed: changes nothing
        assert signal.SIGINT in active_signals()
    assert signal.SIGINT not in active_signals()
    assert set(active_signals()) == {signal.SIGTERM, signal.SIGUSR1}
