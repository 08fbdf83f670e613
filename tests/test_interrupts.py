"""Ctrl-C during a run is noted and raised where the driver's loop looks, never lost."""

from __future__ import annotations

import os
import signal

import pytest

from rlix.supervise import InterruptFlag


class RaisesInFinaliser:
    """Where Python would have lost it: a KeyboardInterrupt raised in __del__ is only printed."""

    def __del__(self) -> None:
        os.kill(os.getpid(), signal.SIGINT)
        sum(range(1000))  # bytecode: the default handler would raise here, and be ignored


def test_the_first_sigint_is_kept_for_the_loop_to_raise_even_from_a_finaliser():
    before = signal.getsignal(signal.SIGINT)
    with InterruptFlag() as flag:
        flag.check()  # nothing yet
        obj = RaisesInFinaliser()
        del obj  # the signal lands inside __del__
        assert flag.count == 1
        with pytest.raises(KeyboardInterrupt):
            flag.check()
    assert signal.getsignal(signal.SIGINT) is before  # restored


def test_a_second_sigint_raises_at_once():
    with InterruptFlag() as flag:
        os.kill(os.getpid(), signal.SIGINT)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            sum(range(1000))
        assert flag.count == 2


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_without_the_flag_a_sigint_in_a_finaliser_is_lost():
    """Why the flag exists: the default handler's KeyboardInterrupt vanishes in __del__.
    (The default handler is installed here: a shell's background job starts with SIGINT
    ignored.)"""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        obj = RaisesInFinaliser()
        del obj  # printed as "Exception ignored in", not raised
        sum(range(1000))
    finally:
        signal.signal(signal.SIGINT, before)
