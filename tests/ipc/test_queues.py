"""Typed ZMQ queues: tensors arrive intact, timeouts, async receive, no-peer sends."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch
import zmq

from mmserve.ipc.messages import AbortRequests, EngineCoreInput, EngineCoreRequest
from mmserve.ipc.private_dirs import make_ipc_dir, remove_private_dir
from mmserve.ipc.queues import QueueReceiver, QueueSender, ipc_address, ipc_path, tcp_address
from mmserve.ipc.serial import MsgpackDecoder, MsgpackEncoder
from mmserve.ipc.items import MultiModalItem, PlaceholderRange
from mmserve.sampling_params import SamplingParams


@pytest.fixture
def pair():
    ipc_dir = make_ipc_dir()
    ctx = zmq.Context()
    try:
        address = ipc_address(ipc_dir, "q")
        receiver = QueueReceiver(ctx, address, MsgpackDecoder(EngineCoreInput), bind=True)
        sender = QueueSender(ctx, address, MsgpackEncoder(), bind=False)
        yield sender, receiver
        sender.close()
        receiver.close()
    finally:
        ctx.destroy(linger=0)
        remove_private_dir(ipc_dir)


def test_ipc_dir_is_per_instance_and_holds_the_socket_files(pair):
    sender, receiver = pair
    path = ipc_path(receiver.address)
    assert os.path.exists(path)
    assert f"mmserve-{os.getpid()}-" in os.path.basename(os.path.dirname(path))
    other = make_ipc_dir()
    assert other != os.path.dirname(path)
    remove_private_dir(other)


def test_messages_with_tensors_arrive_intact(pair):
    sender, receiver = pair
    pixels = torch.randn(3, 336, 336)
    item = MultiModalItem("image", "a", {"pixel_values": pixels}, PlaceholderRange(0, 4))
    sender.send(EngineCoreRequest("r", [1, 2, 3, 4], [item], SamplingParams(), None, 0.0))
    sender.send(AbortRequests(["x"]))
    got = receiver.recv(timeout_s=5)
    assert isinstance(got, EngineCoreRequest)
    assert torch.equal(got.mm_items[0].data["pixel_values"], pixels)
    assert receiver.recv(timeout_s=5) == AbortRequests(["x"])
    assert receiver.recv(timeout_s=0.05) is None
    assert receiver.recv_nowait() is None


def test_a_tcp_queue_binds_a_free_port_and_names_it():
    ctx = zmq.Context()
    try:
        receivers = [QueueReceiver(ctx, tcp_address("127.0.0.1"), MsgpackDecoder(EngineCoreInput), bind=True)
                     for _ in range(2)]
        ports = {int(r.address.rsplit(":", 1)[1]) for r in receivers}
        assert len(ports) == 2 and all(r.address.startswith("tcp://127.0.0.1:") for r in receivers)
        sender = QueueSender(ctx, receivers[1].address, MsgpackEncoder(), bind=False)
        sender.send(AbortRequests(["x"]))
        assert receivers[1].recv(timeout_s=5) == AbortRequests(["x"])
    finally:
        ctx.destroy(linger=0)


def test_send_without_a_peer_times_out():
    ipc_dir = make_ipc_dir()
    ctx = zmq.Context()
    try:
        sender = QueueSender(ctx, ipc_address(ipc_dir, "lonely"), MsgpackEncoder(), bind=True)
        with pytest.raises(TimeoutError, match="no peer"):
            sender.send(AbortRequests([]), timeout_s=0.05)
    finally:
        ctx.destroy(linger=0)
        remove_private_dir(ipc_dir)


def test_async_receive_does_not_block_the_loop_and_cancelling_loses_nothing(pair):
    sender, receiver = pair

    async def main() -> None:
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticker = asyncio.create_task(tick())
        assert await receiver.recv_async(timeout_s=0.2) is None
        assert ticks >= 5
        waiter = asyncio.create_task(receiver.recv_async())
        await asyncio.sleep(0.05)
        waiter.cancel()
        sender.send(AbortRequests(["kept"]))
        assert await receiver.recv_async(timeout_s=5) == AbortRequests(["kept"])
        ticker.cancel()

    asyncio.run(main())
    asyncio.run(main())  # a second event loop reuses the same receiver
