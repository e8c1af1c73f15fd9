"""The shared-memory step broadcast: one writer, N readers, every message once and in order."""

from __future__ import annotations

import os

import msgspec
import pytest
import torch
import zmq

from mmserve.ipc.private_dirs import make_ipc_dir, remove_private_dir
from mmserve.ipc.serial import MsgpackDecoder, MsgpackEncoder
from mmserve.ipc.shm_broadcast import ShmBroadcast, ShmBroadcastReader

pytestmark = pytest.mark.machine_wide  # its processes and /dev/shm are the machine's: one worker runs all such files


class Msg(msgspec.Struct):
    seq: int
    tensor: torch.Tensor | None = None


@pytest.fixture
def ring():
    """A writer with 2 readers, 2 slots of 4 KiB."""
    ctx, ipc_dir = zmq.Context(), make_ipc_dir()
    writer = ShmBroadcast(2, MsgpackEncoder(), ctx, ipc_dir, num_slots=2, slot_bytes=4096)
    readers = [ShmBroadcastReader(writer.info, i, MsgpackDecoder(Msg), ctx) for i in range(2)]
    yield writer, readers
    for reader in readers:
        reader.close()
    writer.close()
    ctx.destroy(linger=0)
    remove_private_dir(ipc_dir)


def test_every_reader_gets_every_message_in_order_across_wraparound(ring):
    writer, readers = ring
    for seq in range(7):  # 2 slots: each is reused three times
        writer.enqueue(Msg(seq, torch.full((4,), float(seq))))
        for reader in readers:
            got = reader.dequeue(timeout_s=1.0)
            assert got.seq == seq and got.tensor.tolist() == [float(seq)] * 4
    assert writer.num_messages == 7 and writer.num_overflows == 0


def test_decoded_tensors_do_not_alias_the_ring(ring):
    writer, readers = ring
    writer.enqueue(Msg(0, torch.arange(100, dtype=torch.float32)))  # 400 bytes: an out-of-band frame
    first = readers[0].dequeue(timeout_s=1.0)
    readers[1].dequeue(timeout_s=1.0)
    writer.enqueue(Msg(1, torch.zeros(100)))
    writer.enqueue(Msg(2, torch.zeros(100)))  # overwrites the slot message 0 used
    assert first.tensor.tolist() == list(range(100))
    first.tensor += 1  # writable, owned by the reader


def test_an_oversized_message_falls_back_to_the_socket_in_order(ring):
    writer, readers = ring
    big = torch.arange(4096, dtype=torch.float32)  # 16 KiB > 4 KiB slots
    writer.enqueue(Msg(0))
    writer.enqueue(Msg(1, big))
    for reader in readers:
        assert reader.dequeue(timeout_s=1.0).seq == 0
        got = reader.dequeue(timeout_s=1.0)
        assert got.seq == 1 and torch.equal(got.tensor, big)
    writer.enqueue(Msg(2))
    assert [r.dequeue(timeout_s=1.0).seq for r in readers] == [2, 2]
    assert writer.num_overflows == 1


def test_waits_are_bounded_and_the_writer_waits_for_the_slowest_reader(ring):
    writer, readers = ring
    assert readers[0].dequeue(timeout_s=0.05) is None  # nothing sent yet
    writer.enqueue(Msg(0))
    writer.enqueue(Msg(1))
    assert readers[0].dequeue(timeout_s=1.0).seq == 0
    checks = []
    with pytest.raises(TimeoutError):  # reader 1 has not read message 0: its slot is not free
        writer.enqueue(Msg(2), timeout_s=0.3, on_wait=lambda: checks.append(1))
    assert checks, "on_wait lets the caller watch its readers while it waits"
    assert readers[1].dequeue(timeout_s=1.0).seq == 0
    writer.enqueue(Msg(2), timeout_s=1.0)


def test_close_unlinks_the_segment():
    ctx, ipc_dir = zmq.Context(), make_ipc_dir()
    writer = ShmBroadcast(1, MsgpackEncoder(), ctx, ipc_dir, num_slots=2, slot_bytes=1024)
    assert os.path.exists(f"/dev/shm/{writer.name}")
    writer.close()
    writer.close()  # idempotent
    assert not os.path.exists(f"/dev/shm/{writer.name}")
    ctx.destroy(linger=0)
    remove_private_dir(ipc_dir)
