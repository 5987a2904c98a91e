"""Preemption signals: which ones, and one handler per signal shared by the launcher and the rank in a process.

Signal dispositions belong to the whole process, so this module keeps one table of what to do per signal: the
launcher part of a process registers a forwarder (pass the signal on to the processes it started), the rank part
a catcher (turn it into `fabric.preempted`). With no catcher, the signal keeps the effect it had before fabric
handled it: by default the process dies of it, as if fabric were not there. A handler installed before fabric's
(submitit's, a user's) is still called after fabric's own. A child forked with multiprocessing (DataLoader workers)
gets the handlers back that were there before fabric: it is no rank and forwards nothing.

Handlers run on the main thread between two bytecodes: they only set flags and pass signals on, never wait.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from typing import Any

from fabric.utilities.exceptions import FabricValueError

PREEMPTION_SIGNALS_ENV = "FABRIC_PREEMPTION_SIGNALS"

_forwarders: dict[int, list[Callable[[int], None]]] = {}
_catchers: dict[int, list[Callable[[int], None]]] = {}  # one per Fabric that reads `preempted`
_previous: dict[int, Any] = {}
_fork_hook_registered = False


def preemption_signals() -> tuple[signal.Signals, ...]:
    """FABRIC_PREEMPTION_SIGNALS (names such as "TERM,USR1"; empty: none), else SIGTERM, plus SIGUSR1 in SLURM."""
    text = os.environ.get(PREEMPTION_SIGNALS_ENV)
    if text is None:
        from fabric.environments.slurm import SLURMEnvironment

        return (signal.SIGTERM, signal.SIGUSR1) if SLURMEnvironment.in_job() else (signal.SIGTERM,)
    found = []
    for name in filter(None, (part.strip().upper() for part in text.split(","))):
        full = name if name.startswith("SIG") else f"SIG{name}"
        if full in ("SIGKILL", "SIGSTOP", "SIGINT") or not hasattr(signal.Signals, full):
            raise FabricValueError(
                f"{PREEMPTION_SIGNALS_ENV}={text!r}: {name!r} cannot announce a preemption (SIGKILL and SIGSTOP "
                "cannot be caught, SIGINT stays Ctrl-C). Use signal names such as TERM, USR1 or USR2, comma "
                "separated, or an empty value for none."
            )
        found.append(signal.Signals[full])
    return tuple(found)


def add_forwarder(signum: int, forward: Callable[[int], None]) -> bool:
    """Run `forward(signum)` first whenever the signal arrives; False if handlers cannot be set in this thread."""
    if not _install(signum):
        return False
    _forwarders.setdefault(signum, []).append(forward)
    return True


def remove_forwarder(signum: int, forward: Callable[[int], None]) -> None:
    """Undo add_forwarder."""
    if forward in _forwarders.get(signum, []):
        _forwarders[signum].remove(forward)
    _uninstall_if_unused(signum)


def add_catcher(signum: int, catch: Callable[[int], None]) -> bool:
    """Handle the signal with `catch(signum)` instead of its previous effect; False outside the main thread."""
    if not _install(signum):
        return False
    _catchers.setdefault(signum, []).append(catch)
    return True


def remove_catcher(signum: int, catch: Callable[[int], None]) -> None:
    """Undo add_catcher: with no catcher left, the signal has its previous effect again."""
    if catch in _catchers.get(signum, []):
        _catchers[signum].remove(catch)
    _uninstall_if_unused(signum)


def _install(signum: int) -> bool:
    if signal.getsignal(signum) is _dispatch:
        return True
    if threading.current_thread() is not threading.main_thread():
        return False  # Python sets handlers only from the main thread
    _register_fork_hook()
    _previous[signum] = signal.getsignal(signum)
    signal.signal(signum, _dispatch)
    return True


def _register_fork_hook() -> None:
    global _fork_hook_registered
    if not _fork_hook_registered and hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_restore_in_child)
        _fork_hook_registered = True


def _restore_in_child() -> None:
    """In a forked child: the handlers from before fabric, and nothing to forward or catch."""
    _forwarders.clear()
    _catchers.clear()
    for signum, previous in list(_previous.items()):
        if signal.getsignal(signum) is _dispatch:
            try:
                signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
            except ValueError:  # forked from a thread other than the main one: Python keeps the parent's
                continue
    _previous.clear()


def _uninstall_if_unused(signum: int) -> None:
    if _forwarders.get(signum) or _catchers.get(signum) or signal.getsignal(signum) is not _dispatch:
        return
    if threading.current_thread() is threading.main_thread():
        signal.signal(signum, _previous.pop(signum, signal.SIG_DFL))


def _dispatch(signum: int, frame: Any) -> None:
    for forward in list(_forwarders.get(signum, [])):
        forward(signum)
    catchers = list(_catchers.get(signum, []))
    for catch in catchers:
        catch(signum)
    previous = _previous.get(signum, signal.SIG_DFL)
    if callable(previous):
        previous(signum, frame)  # installed before fabric's: its owner still expects it (submitit, a user)
    elif catchers or previous == signal.SIG_IGN:
        return
    else:
        # Nobody here treats it as a preemption: die of it, exactly as without fabric.
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
