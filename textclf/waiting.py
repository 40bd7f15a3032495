"""What the other ranks of a launch say while the local main process prepares the tokenizer and the data (minutes
for millions of rows), blocked in a barrier. One process never runs this."""

import os
import threading
import time
from contextlib import contextmanager

# How long a rank waits before it says what for, and again as often. TEXTCLF_WAIT_NOTE_S overrides it (the tests).
WAIT_NOTE_S = 60.0


@contextmanager
def waiting(who: str, what: str):
    """Say that `who` waits for `what`, then again every WAIT_NOTE_S seconds until the block ends: a thread does,
    as a process blocked in a barrier cannot."""
    print(f"{who}: waiting for {what}; then reading both from its caches", flush=True)
    every_s = float(os.environ.get("TEXTCLF_WAIT_NOTE_S", WAIT_NOTE_S))
    done, start = threading.Event(), time.perf_counter()

    def note():
        while not done.wait(every_s):
            print(f"{who}: still waiting for {what} ({time.perf_counter() - start:.0f} s so far)", flush=True)

    thread = threading.Thread(target=note, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
