"""How a benchmark rank ends: at once, once its results are written."""

from __future__ import annotations

import os
import sys
from typing import NoReturn


def exit_without_finalization() -> NoReturn:
    """End this rank once its results are written, without running the interpreter's finalization.

    The trained model's FSDP modules and device meshes hold their process groups until the process ends (destroying
    the groups at exit only unregisters them), so gloo's worker threads are still alive when Python finalizes. Such a
    thread drops its reference to a collective's tensors only after the collective has completed; when it holds the
    last reference to a tensor whose Python object was already released (the recorder's final
    ``all_gather_object``), dropping it takes the GIL. If the main thread has begun finalizing by then, Python 3.11
    ends that thread with ``pthread_exit``, whose unwinding through torch's destructor (noexcept) calls
    ``std::terminate``: the rank aborts with SIGABRT ("terminate called without an active exception") after a
    successful run. ``os._exit`` ends every thread at once instead, as Python's ``multiprocessing`` ends its workers.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
