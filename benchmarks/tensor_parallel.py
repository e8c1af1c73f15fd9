"""Tensor parallelism's step broadcast: what P1 sends each step, and what sending it costs.

One run of the built-in model with --tensor-parallel-size 2 on 1-image requests
(--mm-cache-type lru), then, on the very scheduler outputs of that run:
- bytes per step P1 broadcasts, where items ride once per request (in `NewRequestData`) vs.
  what they would be if every step carried the items of every scheduled request;
- time per step in the shared-memory broadcast (msgpack encode + one copy into the ring, and
  each of the 2 readers' copy-out + decode) vs. pickling the same scheduler output and sending
  it over a Unix socket to each of 2 readers that unpickle it (how a pickle/socket executor
  would do it). Both are replayed in one thread, so they count CPU work, not scheduling luck.

Target: items once per request keep the per-step message >= 10x smaller than items every step;
the ring costs no more than pickle + socket (ratio <= 1).
Run: `python benchmarks/tensor_parallel.py [--requests 8 --max-tokens 32]`.
"""

from __future__ import annotations

import argparse
import pickle
import shutil
import socket
import statistics
import struct
import time

import numpy as np
import zmq
from PIL import Image

from mmserve import LLM, SamplingParams
from mmserve.ipc.worker_messages import ExecuteModel, SchedulerOutput, WorkerInput
from mmserve.ipc.queues import make_ipc_dir
from mmserve.ipc.serial import MsgpackDecoder, MsgpackEncoder
from mmserve.ipc.shm_broadcast import ShmBroadcast, ShmBroadcastReader

READERS = 2


def image(seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).resize((400, 300), Image.BILINEAR)


def record_run(model: str, requests: int, max_tokens: int) -> tuple[list[SchedulerOutput], float]:
    """Serve the requests with TP=2: the scheduler outputs sent, and P1's seconds in the broadcast."""
    llm = LLM(model=model, tensor_parallel_size=2, num_kv_blocks=1024)
    executor = llm.engine.core.executor
    sent: list[SchedulerOutput] = []
    send = executor._send

    def recording_send(msg) -> None:
        if isinstance(msg, ExecuteModel):
            sent.append(msg.scheduler_output)
        send(msg)

    executor._send = recording_send
    ring = executor.broadcast
    seconds = ring.send_s
    prompts = [{"prompt": f"USER: <image>\nDescribe picture {i}. ASSISTANT:", "multi_modal_data": {"image": image(i)}}
               for i in range(requests)]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    seconds = ring.send_s - seconds
    print(f"run: {requests} requests x {max_tokens} tokens, {len(sent)} steps, {ring.num_overflows} message(s) "
          f"over the {ring.slot_bytes >> 20} MiB slot went by socket")
    llm.engine.core.shutdown()
    return sent, seconds


def frame_bytes(encoder: MsgpackEncoder, obj) -> int:
    return sum(memoryview(f).nbytes for f in encoder.encode(obj))


def message_bytes(steps: list[SchedulerOutput]) -> tuple[list[int], list[int]]:
    """Per step: the message's bytes as sent (items once per request), and if each scheduled
    request's items rode along every step."""
    encoder, items, once, every = MsgpackEncoder(), {}, [], []
    for so in steps:
        for new in so.new_requests:
            items[new.request_id] = frame_bytes(encoder, new.mm_items)
        new_ids = {n.request_id for n in so.new_requests}
        once.append(frame_bytes(encoder, ExecuteModel(so)))
        every.append(once[-1] + sum(items.get(rid, 0) for rid in so.num_scheduled_tokens if rid not in new_ids))
    return once, every


def replay_ring(steps: list[SchedulerOutput]) -> list[float]:
    """Seconds of each step: enqueue, then every reader dequeues (copy out + decode)."""
    ctx, ipc_dir = zmq.Context(), make_ipc_dir()
    ring = ShmBroadcast(READERS, MsgpackEncoder(), ctx, ipc_dir)
    readers = [ShmBroadcastReader(ring.info, i, MsgpackDecoder(WorkerInput), ctx) for i in range(READERS)]
    try:
        times = []
        for so in steps:
            start = time.perf_counter()
            ring.enqueue(ExecuteModel(so), timeout_s=10)
            for reader in readers:
                reader.dequeue(timeout_s=10)
            times.append(time.perf_counter() - start)
        return times
    finally:
        for reader in readers:
            reader.close()
        ring.close()
        ctx.destroy(linger=0)
        shutil.rmtree(ipc_dir, ignore_errors=True)


def replay_pickle(steps: list[SchedulerOutput]) -> list[float]:
    """Seconds of each step: pickle once, send to each reader over a Unix socket, each unpickles."""
    pairs = [socket.socketpair() for _ in range(READERS)]
    for a, b in pairs:
        a.setblocking(False)
        b.setblocking(False)
    try:
        times = []
        for so in steps:
            start = time.perf_counter()
            data = pickle.dumps(ExecuteModel(so), protocol=pickle.HIGHEST_PROTOCOL)
            for a, b in pairs:
                pickle.loads(_through(a, b, struct.pack("<Q", len(data)) + data)[8:])
            times.append(time.perf_counter() - start)
        return times
    finally:
        for a, b in pairs:
            a.close()
            b.close()


def _through(a: socket.socket, b: socket.socket, payload: bytes) -> bytearray:
    """Send `payload` on a and receive it on b, interleaved so a full socket buffer never blocks."""
    view, sent, got = memoryview(payload), 0, bytearray()
    while len(got) < len(payload):
        if sent < len(payload):
            try:
                sent += a.send(view[sent:sent + (1 << 20)])
            except BlockingIOError:
                pass
        try:
            got += b.recv(1 << 20)
        except BlockingIOError:
            pass
    return got


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:tiny-llava")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    steps, run_s = record_run(args.model, args.requests, args.max_tokens)
    n = len(steps)
    once, every = message_bytes(steps)
    with_new = [b for b, so in zip(once, steps) if so.new_requests]
    print(f"bytes P1 broadcasts per step: items once per request {sum(once) / n / 1e3:.1f} kB on average "
          f"({len(with_new)} step(s) with new requests, {sum(with_new) / 1e6:.2f} MB in all; the other steps "
          f"{(sum(once) - sum(with_new)) / max(1, n - len(with_new)):.0f} B each); items every step "
          f"{sum(every) / n / 1e3:.1f} kB; ratio {sum(every) / sum(once):.1f}x (target >= 10x)")
    ring_s, pickle_s = replay_ring(steps), replay_pickle(steps)
    new = [i for i, so in enumerate(steps) if so.new_requests]
    rest = [i for i in range(n) if i not in new]
    for name, idx in (("step(s) with new requests", new), ("other steps (median)", rest)):
        r, p = (statistics.median([t[i] for i in idx]) for t in (ring_s, pickle_s))
        print(f"time per step, {READERS} readers, {name}: shm broadcast {r * 1e6:.0f} us, pickle + Unix socket "
              f"{p * 1e6:.0f} us; ratio {r / p:.2f} (target <= 1)")
    print(f"time per step over all {n} steps: shm broadcast {sum(ring_s) / n * 1e6:.0f} us, pickle + Unix socket "
          f"{sum(pickle_s) / n * 1e6:.0f} us; ratio {sum(ring_s) / sum(pickle_s):.2f}; in the TP=2 run itself P1 "
          f"spent {run_s / n * 1e6:.0f} us per step in the broadcast (encode + write, readers not counted)")


if __name__ == "__main__":
    main()
