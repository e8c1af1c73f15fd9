"""`ShmItemReader.attach` gives back the read leases it took when a later handle fails."""

from __future__ import annotations

import pytest

from mmserve.ipc.items import MultiModalItem, PlaceholderRange
from mmserve.transport.shm_items import ShmItemReader


class Lease:
    def __init__(self, held: set[int], key: int) -> None:
        self.held, self.key, self.data = held, key, {}
        held.add(key)

    def release(self) -> None:
        self.held.discard(self.key)


class Reader:
    """A store reader whose third handle is corrupt (raises)."""

    def __init__(self) -> None:
        self.held: set[int] = set()

    def get(self, handle):
        if handle[0] == 2:
            raise ValueError("corrupt handle")
        return Lease(self.held, handle[0])


def test_attach_releases_the_leases_it_took_when_a_later_handle_fails():
    reader = ShmItemReader.__new__(ShmItemReader)
    reader.reader, reader._leases = Reader(), {}
    items = [MultiModalItem("image", f"h{i}", None, PlaceholderRange(0, 1), shm_handle=(i, 0)) for i in range(3)]
    with pytest.raises(ValueError, match="corrupt"):
        reader.attach("r", items)
    assert reader.reader.held == set() and reader._leases == {}
