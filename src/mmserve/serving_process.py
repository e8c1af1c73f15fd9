"""One serving process's set-up: collection paused, title, malloc settings, heap reserve; frozen to serve.

Every serving process (an API server, the launcher, an engine core, a TP worker) starts with
`ServingProcess(name, ...)` and calls `serve()` once it is set up, just before it serves:

- collection is paused until `serve()` (`gc_tuning.py`; an entry point that imports much before it
  knows its name pauses it earlier itself with `gc_tuning.pause_collection`), and `serve()`
  freezes the start-up heap and resumes it;
- the process is titled `mmserve::<name>` (`proc_title.py`);
- glibc keeps freed buffers for reuse (`malloc_tuning.retain_freed_memory`), unless `retain_freed`
  is False (the launcher, which keeps no items);
- `reserve` is a `malloc_tuning.HeapReserve` of `heap_pad_bytes` (disabled at 0), made here, before
  the process starts other threads; the process refills it while idle.
"""

from __future__ import annotations

from mmserve.gc_tuning import freeze_startup_heap, pause_collection
from mmserve.malloc_tuning import HeapReserve, retain_freed_memory
from mmserve.proc_title import set_process_title


class ServingProcess:
    """This process's serving set-up (see the module docstring); one per process."""

    def __init__(self, name: str, heap_pad_bytes: int = 0, retain_freed: bool = True) -> None:
        pause_collection()  # until `serve`
        set_process_title(name)
        if retain_freed:
            retain_freed_memory()
        self.reserve = HeapReserve(heap_pad_bytes)

    def serve(self) -> int:
        """Set up: freeze every object now alive and resume collection; how many objects are frozen."""
        return freeze_startup_heap()
