"""The stop-signal rules of framework/checkpoint/signals.py, each with a real signal delivered to this process (or
to a forked child where the rule ends the process), against the contract docs/CHECKPOINTS.md states:

- SIGTERM and SIGUSR1 ask for a requeue (checkpoint.requeue_exit_code), SIGINT for an interrupt (exit 130);
  when both arrive a requeue wins, whatever the order (a preempted job must be requeued), and the signal named in
  the log is the one that decided;
- a second Ctrl-C aborts at once with 130, without a checkpoint;
- outside the training loop (not armed) a signal raises StopSignal at once, which pickles whole (a forked data
  stage sends it to its parent) and carries the exit code;
- handlers are installed from the main thread only, and `active()` is the innermost installed set.
The end-to-end path (launcher, two ranks, a committed checkpoint) is tests/launch/test_launch_signals.py.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import signal
import threading

import pytest

from framework.checkpoint.config import REQUEUE_EXIT_CODE
from framework.checkpoint.signals import (
    INTERRUPT,
    NO_STOP,
    REQUEUE,
    RunStopped,
    StopSignal,
    StopSignals,
    active,
    check_stopped,
)


def _deliver(*sigs: signal.Signals) -> None:
    for sig in sigs:
        os.kill(os.getpid(), sig)  # handled in the main thread before the next bytecode


@pytest.mark.parametrize("order", [(signal.SIGINT, signal.SIGTERM), (signal.SIGTERM, signal.SIGINT),
                                   (signal.SIGUSR1, signal.SIGINT)])
def test_a_requeue_wins_over_an_interrupt_in_either_order(order: tuple[signal.Signals, ...]) -> None:
    stop = StopSignals().install()
    try:
        stop.requeue_exit_code = 77
        assert not stop.agreed_stop() and stop.agreed == NO_STOP  # control: nothing received yet
        _deliver(*order)
        assert stop.agreed_stop() and stop.agreed == REQUEUE
        assert stop.exit_code == 77
        requeue_sig = next(s for s in order if s != signal.SIGINT)
        assert stop.received == requeue_sig and stop.signal_name == requeue_sig.name
    finally:
        stop.restore()


def test_one_interrupt_exits_130_and_one_requeue_the_configured_code() -> None:
    stop = StopSignals().install()
    try:
        _deliver(signal.SIGINT)
        assert stop.agreed_stop() and stop.agreed == INTERRUPT and stop.exit_code == 130
        assert stop.signal_name == "SIGINT"
    finally:
        stop.restore()
    stop = StopSignals().install()
    try:
        _deliver(signal.SIGUSR1)
        assert stop.agreed_stop() and stop.exit_code == REQUEUE_EXIT_CODE and stop.signal_name == "SIGUSR1"
    finally:
        stop.restore()


def test_a_peer_ranks_signal_is_named_as_such() -> None:
    """After the vote, a rank that caught nothing names the peer's signal that the vote carried."""
    stop = StopSignals(armed=True)
    stop.agreed, stop.agreed_signal = REQUEUE, int(signal.SIGUSR1)
    assert stop.signal_name == "SIGUSR1 (caught by a peer rank)"
    stop.agreed_signal = int(signal.SIGINT)  # a signal of the other kind does not explain a requeue
    assert stop.signal_name == "a peer rank's signal"
    stop.received = int(signal.SIGINT)  # nor does this rank's own interrupt
    assert stop.signal_name == "a peer rank's signal"


def _double_interrupt() -> None:
    StopSignals().install()
    os.kill(os.getpid(), signal.SIGINT)
    os.kill(os.getpid(), signal.SIGINT)
    os._exit(0)  # not reached when the second interrupt aborts


def _single_interrupt() -> None:
    stop = StopSignals().install()
    os.kill(os.getpid(), signal.SIGINT)
    os._exit(5 if stop.kind == INTERRUPT else 6)


def test_a_second_interrupt_aborts_at_once_with_130() -> None:
    ctx = mp.get_context("fork")
    for target, want in ((_double_interrupt, 130), (_single_interrupt, 5)):  # control: one interrupt does not abort
        p = ctx.Process(target=target)
        p.start()
        p.join(30)
        assert p.exitcode == want, (target.__name__, p.exitcode)


def test_unarmed_signals_raise_a_stop_that_pickles_whole() -> None:
    stop = StopSignals(armed=False).install()
    try:
        stop.requeue_exit_code = 77
        with pytest.raises(StopSignal) as err:
            _deliver(signal.SIGTERM)
        assert err.value.exit_code == 77 and err.value.signum == signal.SIGTERM
        with pytest.raises(StopSignal) as err:
            _deliver(signal.SIGINT)
        assert err.value.exit_code == 130
    finally:
        stop.restore()
    back = pickle.loads(pickle.dumps(err.value))
    assert type(back) is StopSignal and back.exit_code == 130 and str(back) == str(err.value)
    stopped = pickle.loads(pickle.dumps(RunStopped("build stopped", 77)))
    assert type(stopped) is RunStopped and stopped.exit_code == 77 and str(stopped) == "build stopped"


def test_check_stopped_raises_only_on_a_nonzero_code() -> None:
    check_stopped(0, "the run")
    with pytest.raises(RunStopped) as err:
        check_stopped(REQUEUE_EXIT_CODE, "the run")
    assert err.value.exit_code == REQUEUE_EXIT_CODE


def test_handlers_install_from_the_main_thread_only_and_active_is_the_innermost() -> None:
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    outer = StopSignals().install()
    inner = StopSignals().install()
    assert active() is inner
    inner.restore()
    assert active() is outer
    outer.restore()
    assert active() is None
    assert {s: signal.getsignal(s) for s in before} == before
    installed: list[StopSignals | None] = []
    t = threading.Thread(target=lambda: installed.append(StopSignals().install() and active()))
    t.start()
    t.join()
    assert installed == [None] and {s: signal.getsignal(s) for s in before} == before
