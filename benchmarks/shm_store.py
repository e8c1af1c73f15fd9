"""The shared-memory object store for 1, 3 and 12 MB image items, against baselines of the same run.

- put: `ShmStore.put` of a new key into a full ring (so every put also evicts) vs `numpy.copyto`
  of the same bytes into a warm buffer. Target: <= 3x. For context, also vs `numpy.copyto` into
  the next slot of a ring-sized private buffer: the same memory traffic as a put, no store.
- get: in another process, `ShmStoreReader.get(handle)` (verify, lock, check, zero-copy views)
  plus `release()`. Target: <= 50 us, flat in item size.
- end to end, P0 -> P1: put + the handle over ZMQ + get (a new item), lookup + handle + get (a
  repeated item), vs the item itself over the ZMQ channel (`mmserve.ipc.serial` + PUSH/PULL ipc),
  decoded in the other process. Times are P0's clock before the first step to P1's after the last
  (CLOCK_MONOTONIC is one clock for all processes); one message in flight at a time.

Run: `python benchmarks/shm_store.py [--runs N]` (needs Linux /dev/shm, about 1 GiB free).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import statistics
import sys
import time

import msgspec
import numpy as np
import torch
import zmq

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from mmserve.ipc.queues import QueueReceiver, QueueSender, ipc_address, make_ipc_dir  # noqa: E402
from mmserve.ipc.serial import MsgpackDecoder, MsgpackEncoder  # noqa: E402
from mmserve.item_store.shm_store import ShmHandle, ShmStore, ShmStoreInfo, ShmStoreReader  # noqa: E402

SHAPES = {1: (3, 296, 296), 3: (3, 512, 512), 12: (3, 1024, 1024)}  # MB -> float32 pixel_values
CAPACITY = 256 << 20


class Inline(msgspec.Struct, tag="inline"):
    t0: float
    data: dict[str, torch.Tensor]


class ByHandle(msgspec.Struct, tag="handle"):
    t0: float
    handle: ShmHandle
    timed: str  # which list the reader adds its time to


class Done(msgspec.Struct, tag="done"):
    pass


Message = Inline | ByHandle | Done


def reader_main(address: str, info_bytes: bytes, conn) -> None:
    """P1's side: time every get on its own, and every message from P0's start to its end here."""
    ctx = zmq.Context()
    inbox: QueueReceiver[Message] = QueueReceiver(ctx, address, MsgpackDecoder(Message), bind=False)
    reader = ShmStoreReader(msgspec.msgpack.decode(info_bytes, type=ShmStoreInfo))
    times: dict[str, list[float]] = {"get": [], "get-after-put": [], "inline": [], "put+get": [], "lookup+get": []}
    conn.send_bytes(b"ready")
    while not isinstance(msg := inbox.recv(), Done):
        if isinstance(msg, Inline):
            times["inline"].append(time.perf_counter() - msg.t0)
        else:
            start = time.perf_counter()
            lease = reader.get(msg.handle)
            end = time.perf_counter()
            assert lease is not None, "entry gone before it was read"
            times["get" if msg.timed == "lookup+get" else "get-after-put"].append(end - start)
            times[msg.timed].append(end - msg.t0)
            lease.release()
        conn.send_bytes(b"")  # ack: one message in flight at a time
    conn.send_bytes(msgspec.msgpack.encode({k: statistics.median(v) for k, v in times.items()}))
    inbox.close()
    reader.close()


def median_s(fn, runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copyto_into_ring_sized(src: np.ndarray, runs: int) -> float:
    """numpy.copyto into the next slot of a touched buffer as big as the ring: never cache-warm."""
    slots = np.ones((CAPACITY // src.nbytes, *src.shape), dtype=src.dtype)
    turn = iter(range(10**9))
    return median_s(lambda: np.copyto(slots[next(turn) % len(slots)], src), runs)


def bench_size(mb: int, runs: int, store: ShmStore, outbox: QueueSender, conn) -> dict[str, float]:
    item = {"pixel_values": torch.rand(SHAPES[mb])}
    src = item["pixel_values"].numpy()
    dst = np.empty_like(src)
    copyto = median_s(lambda: np.copyto(dst, src), runs)
    copyto_cold = copyto_into_ring_sized(src, runs)
    keys = (f"{mb}MB-{i}" for i in range(10**9))
    for _ in range(CAPACITY // src.nbytes + 2):  # one full turn: later puts evict
        store.put(next(keys), item)
    put = median_s(lambda: store.put(next(keys), item), runs)

    def send(msg) -> None:
        outbox.send(msg)
        conn.recv_bytes()

    for _ in range(runs):
        send(Inline(time.perf_counter(), item))
        t0 = time.perf_counter()
        send(ByHandle(t0, store.put(key := next(keys), item), "put+get"))
        send(ByHandle(time.perf_counter(), store.lookup(key), "lookup+get"))
    outbox.send(Done())
    reader = msgspec.msgpack.decode(conn.recv_bytes())
    return {"copyto": copyto, "copyto-cold": copyto_cold, "put": put, **reader}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=60)
    args = parser.parse_args()
    ipc_dir = make_ipc_dir()
    ctx = zmq.Context()
    spawn = multiprocessing.get_context("spawn")
    results = {}
    with ShmStore(CAPACITY) as store:
        for mb in SHAPES:
            address = ipc_address(ipc_dir, f"bench{mb}")
            outbox: QueueSender[Message] = QueueSender(ctx, address, MsgpackEncoder(), bind=True)
            parent, child = spawn.Pipe()
            proc = spawn.Process(target=reader_main, args=(address, msgspec.msgpack.encode(store.info), child))
            proc.start()
            assert parent.recv_bytes() == b"ready"
            results[mb] = bench_size(mb, args.runs, store, outbox, parent)
            proc.join()
            outbox.close()
        stats = store.stats
    ctx.term()
    shutil.rmtree(ipc_dir, ignore_errors=True)
    report(results, stats.evictions)


def report(results: dict[int, dict[str, float]], evictions: int) -> None:
    us = 1e6
    print(f"{'item':>6} {'copyto':>7} {'copyto*':>7} {'put':>7} {'get':>6} {'get*':>6} {'zmq item':>9} "
          f"{'put+get':>8} {'lookup+get':>10}  (us, medians; copyto* = into a ring-sized buffer, "
          "get* = a get right after a put)")
    for mb, r in results.items():
        print(f"{mb:>4}MB {r['copyto'] * us:7.0f} {r['copyto-cold'] * us:7.0f} {r['put'] * us:7.0f} "
              f"{r['get'] * us:6.1f} {r['get-after-put'] * us:6.1f} {r['inline'] * us:9.0f} {r['put+get'] * us:8.0f} "
              f"{r['lookup+get'] * us:10.0f}")
    for mb, r in results.items():
        print(f"{mb} MB: put vs numpy.copyto ratio {r['put'] / r['copyto']:.2f}x (target <= 3x; "
              f"{r['put'] / r['copyto-cold']:.2f}x vs the ring-sized copy); "
              f"get in another process {r['get'] * us:.1f} us (target <= 50 us); "
              f"ZMQ item vs shm put+get ratio {r['inline'] / r['put+get']:.2f}x, "
              f"vs shm lookup+get (a repeated item) ratio {r['inline'] / r['lookup+get']:.0f}x")
    gets = [r["get"] for r in results.values()]
    print(f"get 12 MB vs 1 MB ratio {gets[-1] / gets[0]:.2f}x (target: flat, ~1x); {evictions} evictions on the way")


if __name__ == "__main__":
    main()
