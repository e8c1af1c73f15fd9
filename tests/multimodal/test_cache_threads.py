"""P0's caches under threads (issue 14, case 5): input processing runs in worker threads while
the event loop updates the IPC sender, so every cache call must be atomic. Without the caches'
locks this stress raised KeyError / "OrderedDict mutated during iteration" in the workers and
left the byte accounting wrong."""

from __future__ import annotations

import sys
import threading

import torch

from mmserve.multimodal.cache import IpcSenderCache
from mmserve.multimodal.processor_cache import ProcessorCache
from mmserve.ipc.items import MultiModalItem, PlaceholderRange

THREADS, ROUNDS, KEYS = 8, 3000, 64


def test_threads_hammering_p0_caches_raise_nothing_and_keep_exact_accounting():
    processor, sender = ProcessorCache(60_000), IpcSenderCache(60_000)
    data = [{"pixel_values": torch.zeros(i % 5 + 1, 1000)} for i in range(KEYS)]  # 4 to 20 KB: evicts
    errors: list[str] = []
    barrier = threading.Barrier(THREADS)

    def work(seed: int) -> None:
        try:
            barrier.wait()
            for n in range(ROUNDS):
                k = (n * 7 + seed) % KEYS
                processor.put(f"k{k}", data[k])
                processor.get(f"k{k * 3 % KEYS}")
                sender.update([MultiModalItem("image", f"k{k}", data[k], PlaceholderRange(0, 1))])
                sender.num_tokens(f"k{k * 5 % KEYS}")
        except Exception as e:  # a thread's exception would otherwise be lost
            errors.append(repr(e))

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible
    try:
        threads = [threading.Thread(target=work, args=(s,)) for s in range(THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old)
    assert not errors, errors[:3]
    processor.check_integrity()
    sender.check_integrity()
    assert processor.stats().queries == THREADS * ROUNDS and sender.stats().queries == THREADS * ROUNDS
