import gc
import time

import numpy as np
import pytest

import tessera
from tessera.errors import DescriptorError, TransferError, UnknownObject, UsageError


def pair(backend="shm"):
    a = tessera.Agent("sender", backend=backend)
    b = tessera.Agent("receiver", backend=backend)
    peer = b.add_remote(a.metadata())
    a.add_remote(b.metadata())
    return a, b, peer


@pytest.mark.parametrize("backend", ["shm", "tcp", "inproc"])
def test_put_fetch_free(backend):
    a, b, peer = pair(backend)
    sender = tessera.rdt.SenderPool(a, capacity=16 << 20)
    receiver = tessera.rdt.ReceiverPool(b, capacity=16 << 20)
    ws = [np.arange(1000, dtype=np.float32), np.ones((3, 7), dtype=np.int8), np.zeros(0)]
    desc = sender.put("weights-v1", ws)
    assert isinstance(desc, bytes) and "weights-v1" in sender
    views = receiver.fetch(desc, peer)
    for want, have in zip(ws, views, strict=True):
        np.testing.assert_array_equal(have, want)
        assert have.dtype == want.dtype
    assert receiver.report()["leased"] > 0
    del views
    gc.collect()
    assert receiver.report()["used"] == 0
    sender.free("weights-v1")
    assert sender.report()["used"] == 0
    with pytest.raises(UnknownObject):
        sender.free("weights-v1")


def test_ten_thousand_views_of_one_tensor():
    a, b, peer = pair()
    big = np.arange(10_000 * 16, dtype=np.float32)
    views = [big[i * 16 : (i + 1) * 16] for i in range(10_000)]
    sender = tessera.rdt.SenderPool(a, capacity=8 << 20)
    desc = sender.put(b"many", views)
    got = tessera.rdt.ReceiverPool(b, capacity=8 << 20).fetch(desc, peer)
    assert len(got) == 10_000
    np.testing.assert_array_equal(got[9_999], views[9_999])
    np.testing.assert_array_equal(np.concatenate(got[:100]), big[: 100 * 16])


def test_an_object_that_fits_exactly():
    a, b, peer = pair()
    sender = tessera.rdt.SenderPool(a, capacity=1 << 20)
    desc = sender.put("exact", [np.ones(1 << 18, dtype=np.float32)])  # 1 MiB
    (got,) = tessera.rdt.ReceiverPool(b, capacity=1 << 20).fetch(desc, peer)
    assert got.sum() == 1 << 18


def test_a_failed_read_frees_its_blocks():
    a, b, peer = pair("tcp")  # the sender's agent gone, its listener is closed
    sender = tessera.rdt.SenderPool(a, capacity=4 << 20)
    desc = sender.put("gone", [np.ones(1 << 20, dtype=np.uint8)])
    receiver = tessera.rdt.ReceiverPool(b, capacity=4 << 20)
    sender.free("gone")
    del sender, a
    gc.collect()
    with pytest.raises(TransferError):
        receiver.fetch(desc, peer, timeout=10)
    assert receiver.report()["used"] == 0


def test_bad_descriptors_and_arguments():
    _, b, peer = pair()
    receiver = tessera.rdt.ReceiverPool(b, capacity=1 << 20)
    with pytest.raises(DescriptorError):
        receiver.fetch(b"\x00not a descriptor", peer)
    with pytest.raises(UsageError):
        receiver.fetch(b"", peer, timeout=-1)
    with pytest.raises(tessera.errors.ConfigError, match="unknown engine"):
        tessera.Agent("x", backend="carrier-pigeon")
    if "ucx" not in tessera.backends():
        with pytest.raises(tessera.errors.EngineNotBuilt) as e:
            tessera.Agent("x", backend="ucx")
        assert e.value.feature == "ucx"


def test_a_descriptor_from_another_agent_is_refused():
    _, b, peer = pair()
    other = tessera.Agent("other", backend="shm")
    desc = tessera.rdt.SenderPool(other, capacity=1 << 20).put("x", [np.ones(4)])
    with pytest.raises(DescriptorError, match="put by agent"):
        tessera.rdt.ReceiverPool(b, capacity=1 << 20).fetch(desc, peer)


def test_a_cancelled_fetch_fails_and_frees_its_blocks():
    _, b, peer = pair()
    a2 = tessera.Agent("sender-c", backend="shm")
    peer = b.add_remote(a2.metadata())
    sender = tessera.rdt.SenderPool(a2, capacity=8 << 20)
    desc = sender.put("c", [np.ones(4 << 20, np.uint8)])
    receiver = tessera.rdt.ReceiverPool(b, capacity=8 << 20)
    cancel = tessera.rdt.Cancel()
    cancel.cancel()
    assert cancel.cancelled
    with pytest.raises(TransferError, match="cancelled"):
        receiver.fetch(desc, peer, cancel=cancel)
    deadline = time.monotonic() + 10
    while receiver.report()["used"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert receiver.report()["used"] == 0
    (got,) = receiver.fetch(desc, peer, cancel=tessera.rdt.Cancel())
    assert got.sum() == 4 << 20


@pytest.mark.parametrize("backend", ["shm", "tcp"])
def test_a_fetch_into_the_callers_buffers_lands_in_them(backend):
    a, b, peer = pair(backend)
    sender = tessera.rdt.SenderPool(a, capacity=8 << 20)
    ws = [np.arange(100_000, dtype=np.float32), np.zeros(0, np.int8), np.full((3, 5), 7, np.int16)]
    desc = sender.put("into", ws)
    receiver = tessera.rdt.ReceiverPool(b, capacity=1 << 20)
    into = [np.empty_like(w) for w in ws]
    ptrs = [t.ctypes.data for t in into]
    copies = tessera.copies()
    got = receiver.fetch(desc, peer, into=into)
    assert [t.ctypes.data for t in got] == ptrs
    for want, have in zip(ws, into, strict=True):
        np.testing.assert_array_equal(have, want)
    # No receive block was taken: the object is larger than the receive pool.
    assert receiver.report()["used"] == 0
    assert tessera.copies() == copies
    # Again into the same buffers, after the sender changed nothing: same bytes.
    into[0][:] = 0
    receiver.fetch(desc, peer, into=into)
    np.testing.assert_array_equal(into[0], ws[0])


def test_a_fetch_into_checks_every_buffer_first():
    a, b, peer = pair()
    sender = tessera.rdt.SenderPool(a, capacity=1 << 20)
    desc = sender.put("chk", [np.ones(16, np.float32), np.ones(4, np.int64)])
    receiver = tessera.rdt.ReceiverPool(b, capacity=1 << 20)
    good = [np.zeros(16, np.float32), np.zeros(4, np.int64)]
    with pytest.raises(UsageError, match="gives 1 tensors for an object of 2"):
        receiver.fetch(desc, peer, into=good[:1])
    with pytest.raises(
        UsageError, match=r"into\[1\] is int32\[4\]; the object's tensor 1 is int64\[4\]"
    ):
        receiver.fetch(desc, peer, into=[good[0], np.zeros(4, np.int32)])
    with pytest.raises(UsageError, match=r"into\[0\] is float32\[8\]"):
        receiver.fetch(desc, peer, into=[np.zeros(8, np.float32), good[1]])
    ro = np.zeros(16, np.float32)
    ro.flags.writeable = False
    with pytest.raises(UsageError, match="read-only"):
        receiver.fetch(desc, peer, into=[ro, good[1]])
    with pytest.raises(UsageError, match="not C-contiguous"):
        receiver.fetch(desc, peer, into=[np.zeros(32, np.float32)[::2], good[1]])
    with pytest.raises(tessera.errors.ValueTypeError):
        receiver.fetch(desc, peer, into=[object(), good[1]])
    # A refused fetch wrote nothing.
    assert not good[0].any() and not good[1].any()
    receiver.fetch(desc, peer, into=good)
    assert good[0].sum() == 16 and good[1].sum() == 4
