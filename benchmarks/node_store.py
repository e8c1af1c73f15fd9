"""The node's item store (several API servers, `--mm-cache-type shm`) against a server's own store,
for 1, 3 and 12 MB image items, in the same run.

- put of a new key: `NodeStoreClient.put` (reserve round trip, the server's own copy into the
  segment, seal round trip; the owner runs in another thread, as in the launcher) vs
  `ShmStore.put` of one API server (no round trip).
- lookup of a present key (one round trip) vs `ShmStore.lookup`.
- fetch (the processor cache's copy of another server's item) vs `torch.clone` of the same item.

Run: `PYTHONPATH=src python benchmarks/node_store.py [--runs N]`.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import time
from collections.abc import Callable

import msgspec
import torch

from mmserve.ipc.items import ShmStoreInfo
from mmserve.item_store.node_store import NodeStoreClient, NodeStoreServer
from mmserve.ipc.queues import make_ipc_dir
from mmserve.item_store.shm_store import ShmStore

SHAPES = {1: (3, 296, 296), 3: (3, 512, 512), 12: (3, 1024, 1024)}  # MB -> float32 pixel_values
CAPACITY = 256 << 20


def median_us(fn: Callable[[int], object], runs: int) -> float:
    times = []
    for i in range(runs):
        start = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def put(store: ShmStore | NodeStoreClient, key: str, item: dict[str, torch.Tensor]) -> None:
    """A new item's put for a request that then ends (its pin dropped); refused puts are an error here."""
    assert store.put(key, item, "r") is not None, "the store refused the put"
    store.finish_request("r")


def bench_size(mb: int, item: dict[str, torch.Tensor], own: ShmStore, client: NodeStoreClient, runs: int) -> str:
    """One table row for items of `mb` MB."""
    last = f"{mb}-{runs - 1}"
    own_put = median_us(lambda i: put(own, f"{mb}-{i}", item), runs)
    node_put = median_us(lambda i: put(client, f"{mb}-{i}", item), runs)
    own_lookup = median_us(lambda i: own.lookup(last), runs)
    node_lookup = median_us(lambda i: client.lookup(last), runs)
    clone = median_us(lambda i: {k: v.clone() for k, v in item.items()}, runs)
    assert client.fetch(last) is not None
    fetch = median_us(lambda i: client.fetch(last), runs)
    return (f"{mb:>3}MB {own_put:8.0f} {node_put:9.0f} {node_put / own_put:5.2f}x {own_lookup:11.1f} "
            f"{node_lookup:12.0f} {clone:6.0f} {fetch:6.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=100)
    args = parser.parse_args()
    ipc_dir = make_ipc_dir()
    server = NodeStoreServer(ShmStore(CAPACITY), ipc_dir)
    server.start()
    client = NodeStoreClient(server.address, msgspec.msgpack.decode(server.info, type=ShmStoreInfo), 0)
    own = ShmStore(CAPACITY)
    try:
        print(f"{'item':>5} {'own put':>8} {'node put':>9} {'ratio':>6} {'own lookup':>11} {'node lookup':>12} "
              f"{'clone':>6} {'fetch':>6}   (us, medians of {args.runs})")
        for mb, shape in SHAPES.items():
            print(bench_size(mb, {"pixel_values": torch.randn(shape)}, own, client, args.runs))
    finally:
        client.close()
        server.close()
        own.close()
        shutil.rmtree(ipc_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
