"""A group fails as a unit: every rank ends when another rank of its group stops showing signs of life."""

from __future__ import annotations

import logging
import os
import threading
import time

import torch.distributed as dist

log = logging.getLogger(__name__)


class GroupWatchdog:
    """Ends this process when another rank of its group stops showing signs of life.

    Every rank writes a heartbeat into the job's TCP store and reads the others'; a rank silent for ``timeout``
    seconds (dead, or stopped) makes every other rank of the group exit, so that the group fails as a unit and its
    manager stops heartbeating to the lighthouse. Without it a half-dead group keeps the federation waiting at every
    quorum.

    Args:
        timeout: Seconds of silence before the group ends.
        interval: Seconds between two heartbeats.
    """

    def __init__(self, timeout: float, interval: float = 1.0) -> None:
        self.timeout = timeout
        self.interval = min(interval, timeout / 4)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fedshard-group-watchdog", daemon=True)

    def start(self) -> None:
        """Start watching (in a daemon thread)."""
        self._thread.start()

    def stop(self) -> None:
        """Stop watching."""
        self._stop.set()

    def _run(self) -> None:
        try:
            store = dist.TCPStore(
                os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, wait_for_workers=False
            )
            rank, world = dist.get_rank(), dist.get_world_size()
        except Exception as error:  # no store to watch through: say so, the group is then not watched
            log.warning(f"The elastic group watchdog could not reach the job's store and is off: {error}")
            return
        last_seen = {r: time.monotonic() for r in range(world) if r != rank}
        beats = dict.fromkeys(last_seen, -1)
        while not self._stop.wait(self.interval):
            try:
                store.add(f"fedshard/alive/{rank}", 1)  # a counter: `add` never waits for a key to exist
                values = [store.add(f"fedshard/alive/{r}", 0) for r in last_seen]
            except Exception as error:  # the store lives with rank 0: it is gone
                self._end(f"the group's store is gone ({error})")
                return
            now = time.monotonic()
            for r, value in zip(list(last_seen), values):
                if value != beats[r]:
                    beats[r], last_seen[r] = value, now
                elif now - last_seen[r] > self.timeout:
                    self._end(f"rank {r} of this group has shown no sign of life for {self.timeout:g} s")
                    return

    @staticmethod
    def _end(reason: str) -> None:
        log.error(f"Ending this elastic group: {reason}. A group fails as a unit; restart it to rejoin.")
        logging.shutdown()
        os._exit(75)


__all__ = ["GroupWatchdog"]
