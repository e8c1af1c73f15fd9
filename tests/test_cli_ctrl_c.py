"""`cli.CtrlC`: a Ctrl-C that lands inside an import is deferred until the main thread has left it,
then sent again; one that lands in an import again (the main thread was between two imports when
it was sent) is deferred again, never dropped. CI saw the drop: a Ctrl-C during a loaded start
that the server never took, serving on until the test's 60 s ran out."""

from __future__ import annotations

import signal
from types import SimpleNamespace

import pytest

from mmserve import cli


def in_import() -> SimpleNamespace:
    """A frame as the handler sees one inside an import: importlib's machinery below it."""
    machinery = SimpleNamespace(f_code=SimpleNamespace(co_filename="<frozen importlib._bootstrap>"), f_back=None)
    return SimpleNamespace(f_code=SimpleNamespace(co_filename="module.py"), f_back=machinery)


def test_a_ctrl_c_sent_again_into_the_next_import_is_deferred_again(monkeypatch):
    waiters: list = []

    class Recorded:  # the waiter thread, recorded rather than started: the test runs it
        def __init__(self, target, name, daemon):
            self.target = target

        def start(self):
            waiters.append(self.target)

    monkeypatch.setattr(cli.threading, "Thread", Recorded)
    ctrl_c = cli.CtrlC()
    with ctrl_c:
        assert signal.getsignal(signal.SIGINT) == ctrl_c._handle
        ctrl_c._handle(signal.SIGINT, in_import())  # Ctrl-C inside an import: deferred
        ctrl_c._handle(signal.SIGINT, in_import())  # a second press there: the one waiter sends it once
        assert len(waiters) == 1 and ctrl_c.pressed
        # the waiter sends it again as the main thread enters the next import: it lands there
        monkeypatch.setattr(cli.signal, "raise_signal", lambda signum: ctrl_c._handle(signum, in_import()))
        waiters[0]()
        assert len(waiters) == 2, "a Ctrl-C sent again into the next import was dropped"
        monkeypatch.undo()  # the real `raise_signal`: out of every import the handler raises
        with pytest.raises(KeyboardInterrupt):
            waiters[1]()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
