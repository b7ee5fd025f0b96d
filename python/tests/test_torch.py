import gc

import numpy as np
import pytest

import tessera
from tessera.errors import UsageError

torch = pytest.importorskip("torch")

DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.uint16,
    torch.int16,
    torch.uint32,
    torch.int32,
    torch.uint64,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.complex128,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]


def sample(dtype, shape=(4, 3)):
    if dtype.is_complex:
        return torch.randn(shape, dtype=dtype)
    if dtype == torch.bool:
        return torch.rand(shape) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape).to(dtype)
    return torch.randint(0, 100, shape).to(dtype)


def same(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_every_dtype_round_trips_as_torch(torch_client):
    values = [sample(d) for d in DTYPES]
    torch_client.put("t", list(range(len(values))), {"x": values})
    got = torch_client.get("t", list(range(len(values))), ["x"])["x"]
    for want, have in zip(values, got, strict=True):
        assert isinstance(have, torch.Tensor)
        same(have, want)


def test_numpy_results_of_a_dtype_numpy_lacks_say_to_ask_for_torch(client):
    client.put("bf", [0], {"x": [torch.ones(3, dtype=torch.bfloat16)]})
    with pytest.raises(UsageError, match='tensor_type="torch"'):
        client.get("bf", [0], ["x"])


def test_torch_results_are_pool_views_kept_by_any_slice(torch_client):
    data = torch.arange(1 << 20, dtype=torch.float32)
    torch_client.put("v", [0], {"x": [data]})
    (got,) = torch_client.get("v", [0], ["x"])["x"]
    r = torch_client.report()
    assert r["address"] <= got.data_ptr() < r["address"] + r["capacity"]
    same(got, data)
    part = got[5:9]
    arr = got.numpy()
    del got
    gc.collect()
    assert torch_client.report()["used"] > 0
    assert part.tolist() == [5.0, 6.0, 7.0, 8.0]
    del part
    gc.collect()
    assert torch_client.report()["used"] > 0, "the .numpy() view keeps the block too"
    del arr
    gc.collect()
    assert torch_client.report()["used"] == 0


def test_a_batched_torch_column_is_split_without_a_copy(unit, torch_client):
    copies = tessera.copies()
    batch = torch.arange(16 * 1024, dtype=torch.int32).reshape(16, 1024)
    before = unit.stats()["bytes_in"]
    torch_client.put("rows", list(range(16)), {"tokens": batch})
    assert unit.stats()["bytes_in"] - before < batch.numel() * 4 + 64 * 1024
    assert tessera.copies() == copies
    got = torch_client.get("rows", [3, 15], ["tokens"])["tokens"]
    same(got[0], batch[3])
    same(got[1], batch[15])


def test_a_transposed_tensor_is_copied_once(torch_client):
    t = torch.arange(12, dtype=torch.float64).reshape(3, 4).T
    count, nbytes = tessera.copies()
    torch_client.put("tr", [0], {"x": [t]})
    assert tessera.copies() == (count + 1, nbytes + t.numel() * 8)
    same(torch_client.get("tr", [0], ["x"])["x"][0], t.contiguous())


def test_a_recycled_address_never_reuses_a_stale_registration(torch_client):
    """ray-project/ray#65701: free a tensor, allocate another at the same address, PUT it: the
    bytes stored must be the new tensor's. (NumPy's allocator hands a freed block of the same
    size straight back; torch.from_numpy makes torch tensors of it.)"""
    n = 1 << 18  # 1 MiB of float32: registered in place, not inline
    reused = 0
    for i in range(8):
        a = torch.from_numpy(np.full(n, float(i), dtype=np.float32))
        addr = a.data_ptr()
        torch_client.put("rec", [0], {"x": [a]})
        del a
        b = torch.from_numpy(np.full(n, float(i) + 0.5, dtype=np.float32))
        reused += b.data_ptr() == addr
        torch_client.put("rec", [1], {"x": [b]})
        got = torch_client.get("rec", [0, 1], ["x"])["x"]
        assert got[0][0].item() == float(i) and got[1][-1].item() == float(i) + 0.5
        del b, got
    assert reused, "the allocator never handed the same address back: the case was not tested"


def test_tessera_tensors_view_in_both_libraries(unit):
    with tessera.storage.Client(
        units=[unit.address], recv_pool_bytes=64 << 20, tensor_type="tessera"
    ) as c:
        c.put("tt", [0], {"x": [np.arange(10, dtype=np.int64)]})
        (t,) = c.get("tt", [0], ["x"])["x"]
        assert isinstance(t, tessera.Tensor) and t.dtype == "int64" and t.shape == [10]
        assert torch.from_dlpack(t).data_ptr() == t.data_ptr == t.numpy().ctypes.data
        assert np.from_dlpack(t).sum() == 45


def test_a_tensor_that_requires_grad_is_stored_by_its_data(torch_client):
    w = torch.randn(1000, requires_grad=True)
    torch_client.put("grad", [0], {"w": [w]})
    (got,) = torch_client.get("grad", [0], ["w"])["w"]
    same(got, w.detach())
    assert not got.requires_grad


def test_a_fetch_lands_in_the_callers_torch_tensors():
    a, b = tessera.Agent("tx", backend="shm"), tessera.Agent("rx", backend="shm")
    peer = b.add_remote(a.metadata())
    ws = [sample(torch.bfloat16, (64, 32)), sample(torch.float8_e4m3fn, (7,)), torch.zeros(0)]
    sender = tessera.rdt.SenderPool(a, capacity=1 << 20)
    desc = sender.put("w", ws)
    receiver = tessera.rdt.ReceiverPool(b, capacity=1 << 20, tensor_type="torch")
    into = [torch.empty_like(w) for w in ws]
    got = receiver.fetch(desc, peer, into=into)
    assert all(g is t for g, t in zip(got, into, strict=True))
    for want, have in zip(ws, into, strict=True):
        same(want, have)
    assert receiver.report()["used"] == 0
    # A tensor that requires grad is received into through its data.
    grad = torch.zeros(64, 32, dtype=torch.bfloat16, requires_grad=True)
    receiver.fetch(desc, peer, into=[grad, into[1], into[2]])
    same(ws[0], grad.detach())
    with pytest.raises(UsageError, match="not contiguous"):
        receiver.fetch(desc, peer, into=[torch.empty(32, 64, dtype=torch.bfloat16).t(), *into[1:]])


def test_torch_results_take_the_exchange_api_not_from_dlpack():
    # torch.from_dlpack is the slow path (a Python call and a capsule per tensor): with it
    # broken, results still come, through the C exchange API.
    import subprocess
    import sys

    script = """
import numpy as np, torch, tessera
def broken(*a, **k):
    raise AssertionError("torch.from_dlpack was called")
torch.from_dlpack = broken
a, b = tessera.Agent("x", backend="shm"), tessera.Agent("y", backend="shm")
peer = b.add_remote(a.metadata())
s = tessera.rdt.SenderPool(a, capacity=1 << 20)
d = s.put("o", [np.arange(4, dtype=np.float32)])
(t,) = tessera.rdt.ReceiverPool(b, capacity=1 << 20, tensor_type="torch").fetch(d, peer)
assert isinstance(t, torch.Tensor) and t.tolist() == [0.0, 1.0, 2.0, 3.0]
"""
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)


def test_a_sender_pool_put_takes_strided_and_odd_torch_views():
    a, b = tessera.Agent("sx", backend="shm"), tessera.Agent("sy", backend="shm")
    peer = b.add_remote(a.metadata())
    base = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    ws = [
        base.t(),  # strided: copied from its view
        base[:, 3:4],  # [6, 1], a column: strided in its first dimension
        base[2:3],  # [1, 10]: contiguous whatever the stride of the unit dimension
        base[0, :0],  # empty
        base.unsqueeze(0)[:, 1],  # [1, 10] through a unit dimension
    ]
    sender = tessera.rdt.SenderPool(a, capacity=1 << 20)
    got = tessera.rdt.ReceiverPool(b, capacity=1 << 20, tensor_type="torch").fetch(
        sender.put("w", ws), peer
    )
    for want, have in zip(ws, got, strict=True):
        assert have.shape == want.shape and torch.equal(have, want.contiguous())
