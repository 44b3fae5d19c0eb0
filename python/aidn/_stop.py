"""should_stop(): the coordinator said stop, the generation is over, or
SIGTERM arrived (the worker's stop order, or anyone's kill)."""

import logging
import signal
import threading

from . import _job

log = logging.getLogger("aidn")

_lock = threading.Lock()
_installed = False
_sigterm = threading.Event()
_previous = None


def _on_sigterm(signum, frame):
    _sigterm.set()
    # A handler of the program's own, installed before ours, still runs.
    if callable(_previous):
        _previous(signum, frame)


def _install_once() -> None:
    """Takes over SIGTERM on the first call only, so that a program that
    never asks keeps the default (terminate at once)."""
    global _installed, _previous
    with _lock:
        if _installed:
            return
        _installed = True
        try:
            _previous = signal.signal(signal.SIGTERM, _on_sigterm)
        except ValueError:  # not the main thread: signal handlers cannot be set here
            log.warning("aidn: should_stop() first called off the main thread: SIGTERM keeps "
                        "its default action")


def should_stop() -> bool:
    """True once the coordinator said stop (a progress answer), the
    generation was fenced off (FAILED_PRECONDITION), or SIGTERM arrived. The
    first call installs the SIGTERM handler."""
    _install_once()
    if _sigterm.is_set():
        return True
    reporter = _job.current().reporter_if_started()
    return reporter is not None and (reporter.fenced or reporter.stop_reason is not None)

