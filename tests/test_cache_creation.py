"""Creating a cache directory: the mode set on what was made, never on what a racer put there.

A racer who can swap the new directory for a symlink between its mkdir and
its chmod would get the link's target chmodded; the mode is set through a
descriptor opened without following a link, and the parents are checked
before anything is made (issue 29, 9). Real directories, a real racing
thread, real symlinks.
"""

from __future__ import annotations

import contextlib
import os
import stat
import threading

import pytest

from worker.cache import UntrustedCacheError
from worker.cache.trust import make_directory

ROUNDS = 3000


@pytest.mark.slow
def test_a_directory_swapped_for_a_symlink_never_gets_its_target_chmodded(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("private")
    victim.chmod(0o600)
    cache, aside = tmp_path / "cache", tmp_path / "aside"
    stop = threading.Event()
    swaps = 0

    def racer() -> None:
        nonlocal swaps
        while not stop.is_set():
            with contextlib.suppress(OSError):
                os.rename(cache, aside)
                os.symlink(victim, cache)
                swaps += 1
                os.rmdir(aside)

    thread = threading.Thread(target=racer)
    thread.start()
    refused = 0
    try:
        for _ in range(ROUNDS):
            with contextlib.suppress(OSError):  # the racer may swap it meanwhile
                os.unlink(cache) if cache.is_symlink() else os.rmdir(cache)
            try:
                make_directory(cache, shared=True)
            except OSError:
                refused += 1
            assert stat.S_IMODE(victim.stat().st_mode) == 0o600, (swaps, refused)
    finally:
        stop.set()
        thread.join()
    assert swaps > 0  # the race was run
    assert victim.read_text() == "private"


def test_parents_are_checked_before_the_directory_is_made(tmp_path):
    open_parent = tmp_path / "open"
    open_parent.mkdir()
    open_parent.chmod(0o777)  # anyone may replace what is made inside it
    with pytest.raises(UntrustedCacheError, match="anyone can replace"):
        make_directory(open_parent / "cache", shared=False)
    assert not (open_parent / "cache").exists()
    made = tmp_path / "fine"
    assert make_directory(made, shared=True) is True
    assert stat.S_IMODE(os.stat(made).st_mode) == 0o2770
    assert make_directory(made, shared=True) is False
