import _thread
import asyncio
import gc
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import tessera
from tessera.errors import (
    AuthError,
    ClosedError,
    ConnectError,
    DeviceError,
    ForkedError,
    MissingKeys,
    StorageError,
    TesseraError,
    UsageError,
    ValueTypeError,
)

NUMPY_DTYPES = [
    np.bool_,
    np.uint8,
    np.int8,
    np.uint16,
    np.int16,
    np.uint32,
    np.int32,
    np.uint64,
    np.int64,
    np.float16,
    np.float32,
    np.float64,
    np.complex64,
    np.complex128,
]


def pool_range(client):
    r = client.report()
    return r["address"], r["address"] + r["capacity"]


def test_numpy_round_trip_of_every_dtype(client):
    rng = np.random.default_rng(0)
    values = []
    for dt in NUMPY_DTYPES:
        raw = rng.integers(0, 100, size=(3, 5)).astype(dt)
        values.append(raw)
    client.put("p", list(range(len(values))), {"t": values})
    got = client.get("p", list(range(len(values))), ["t"])["t"]
    for want, have in zip(values, got, strict=True):
        assert have.dtype == want.dtype
        assert have.shape == want.shape
        np.testing.assert_array_equal(have, want)


def test_nested_values_round_trip(client):
    value = {
        "none": None,
        "flag": True,
        "n": -7,
        "big": 2**63 + 5,
        "x": 0.25,
        "s": "héllo",
        "b": b"\x00\x01bytes",
        "list": [1, [2.5, "three"], {"k": None}],
        "t": np.arange(4, dtype=np.int32),
    }
    client.put("nested", [0], {"v": [value]})
    got = client.get("nested", [0], ["v"])["v"][0]
    t = got.pop("t")
    want = dict(value)
    np.testing.assert_array_equal(t, want.pop("t"))
    assert got == {**want, "list": [1, [2.5, "three"], {"k": None}]}


def test_tuples_come_back_as_lists(client):
    client.put("p", [0], {"v": [(1, 2)]})
    assert client.get("p", [0], ["v"])["v"] == [[1, 2]]


def test_a_batched_column_is_split_into_rows(client):
    batch = np.arange(4 * 6, dtype=np.int64).reshape(4, 6)
    client.put("b", [10, 11, 12, 13], {"tokens": batch, "reward": [0.5, 1.0, 1.5, 2.0]})
    got = client.get("b", [12, 10], ["tokens", "reward"])
    np.testing.assert_array_equal(got["tokens"][0], batch[2])
    np.testing.assert_array_equal(got["tokens"][1], batch[0])
    assert got["reward"] == [1.5, 0.5]


def test_put_moves_each_payload_byte_once(unit, client):
    before = unit.stats()["bytes_in"]
    copies = tessera.copies()
    data = np.ones((8, 1 << 20), dtype=np.uint8)  # 8 MiB, contiguous
    client.put("once", list(range(8)), {"x": data})
    moved = unit.stats()["bytes_in"] - before
    assert data.nbytes <= moved < data.nbytes + 64 * 1024  # payload once, plus metadata
    assert tessera.copies() == copies  # nothing copied on the way in


def test_get_results_are_views_of_the_receive_pool(client):
    data = np.arange(1 << 20, dtype=np.float32)  # 4 MiB: not inline
    client.put("v", [0], {"x": [data]})
    got = client.get("v", [0], ["x"])["x"][0]
    lo, hi = pool_range(client)
    ptr = got.__array_interface__["data"][0]
    assert lo <= ptr and ptr + got.nbytes <= hi
    np.testing.assert_array_equal(got, data)
    assert got.flags.writeable


def test_the_block_returns_when_the_last_view_is_gone(client):
    data = np.arange(1 << 20, dtype=np.float32)
    client.put("life", [0, 1], {"x": [data, data]})
    got = client.get("life", [0, 1], ["x"])["x"]
    assert client.report()["used"] > 0
    part = got[1][10:20]
    del got
    gc.collect()
    assert client.report()["used"] > 0, "a slice alone keeps its block"
    np.testing.assert_array_equal(part, data[10:20])
    del part
    gc.collect()
    assert client.report()["used"] == 0


def test_non_contiguous_tensors_are_copied_once_and_counted(client):
    base = np.arange(64, dtype=np.int16).reshape(8, 8)
    view = base[:, ::2]
    count, nbytes = tessera.copies()
    client.put("nc", [0], {"x": [view]})
    assert tessera.copies() == (count + 1, nbytes + view.nbytes)
    np.testing.assert_array_equal(client.get("nc", [0], ["x"])["x"][0], view)
    flipped = base[::-1]
    client.put("nc", [1], {"x": [flipped]})
    np.testing.assert_array_equal(client.get("nc", [1], ["x"])["x"][0], flipped)


def test_buffer_protocol_objects_are_tensors(client):
    client.put("buf", [0, 1], {"x": [bytearray(b"abc"), memoryview(b"xyz")]})
    got = client.get("buf", [0, 1], ["x"])["x"]
    assert bytes(got[0]) == b"abc" and bytes(got[1]) == b"xyz"
    assert got[0].dtype == np.uint8


def test_missing_keys_name_them(client):
    client.put("m", [0], {"f": [1]})
    with pytest.raises(MissingKeys) as e:
        client.get("m", [0, 5], ["f"])
    assert e.value.kind == "missing"
    assert ("f", 5) in [tuple(k) for k in e.value.missing]
    assert isinstance(e.value, StorageError) and isinstance(e.value, TesseraError)


def test_clear_indexes_fields_and_partitions(client):
    client.put("c", [0, 1], {"a": [1, 2], "b": [3, 4]})
    client.clear("c", [0], fields=["a"])
    assert client.get("c", [0], ["b"]) == {"b": [3]}
    with pytest.raises(MissingKeys):
        client.get("c", [0], ["a"])
    client.clear("c", [1])
    with pytest.raises(MissingKeys):
        client.get("c", [1], ["b"])
    client.clear("c", all=True)
    with pytest.raises(UsageError):
        client.clear("c")
    with pytest.raises(UsageError):
        client.clear("c", [0], all=True)


def test_stats_is_one_dict_per_unit(client):
    client.put("s", [0], {"f": [np.zeros(10)]})
    (stats,) = client.stats()
    assert stats["keys"] >= 1 and "pool" in stats and "bytes_in" in stats


def test_bad_inputs_raise_clear_errors(client):
    with pytest.raises(ValueTypeError) as e:
        client.put("bad", [0], {"f": [object()]})
    assert isinstance(e.value, TypeError) and "cannot store a object" in str(e.value)
    with pytest.raises(UsageError, match="0 or more"):
        client.put("bad", [-1], {"f": [1]})
    with pytest.raises(UsageError, match="2 values for 1 indexes"):
        client.put("bad", [0], {"f": [1, 2]})
    with pytest.raises(UsageError, match="first dimension"):
        client.put("bad", [0, 1], {"f": np.zeros((3, 2))})
    with pytest.raises(ValueTypeError):
        client.put("bad", [0], {"f": [{1: "not a str key"}]})
    with pytest.raises(UsageError, match="64 bits"):
        client.put("bad", [0], {"f": [1 << 70]})
    with pytest.raises(UsageError, match="tensor_type"):
        tessera.storage.Client(units=["127.0.0.1:1"], tensor_type="jax")


class CudaLike:
    """A DLPack producer that says its memory is on a GPU."""

    def __dlpack_device__(self):
        return (2, 0)

    def __dlpack__(self, **kwargs):
        raise AssertionError("a device tensor must be refused before it is exported")


def test_device_tensors_are_refused_before_export(client):
    with pytest.raises(DeviceError, match=r"cuda:0.*\.cpu\(\)"):
        client.put("dev", [0], {"f": [CudaLike()]})


def test_a_closed_client_says_so(unit):
    c = tessera.storage.Client(units=[unit.address], recv_pool_bytes=1 << 20)
    c.close()
    c.close()
    with pytest.raises(ClosedError):
        c.put("p", [0], {"f": [1]})


def _shared_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssShmem:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssShmem in /proc/self/status")


def _settled_shared_rss() -> int:
    """`_shared_rss` once what earlier tests mapped is gone: a closed client's or unit's
    mappings are released by the runtime's threads after `close` returns, and one released
    between two readings of a test would take its size off what the test measured."""
    gc.collect()
    last = _shared_rss()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = _shared_rss()
        if now == last:
            return now
        last = now
    return last


def test_prefaulted_pools_are_resident_from_the_start():
    mib = 1 << 20
    before = _settled_shared_rss()
    with tessera.storage.Server(
        pool_bytes=32 * mib, pool_chunk_bytes=8 * mib, prefault_pool=True
    ) as u:
        assert u.registered_bytes() == 32 * mib
        with_unit = _shared_rss()
        assert with_unit - before >= 32 * mib
        with tessera.storage.Client(
            units=[u.address], recv_pool_bytes=64 * mib, prefault_recv_pool=True
        ) as c:
            assert _shared_rss() - with_unit >= 64 * mib
            c.put("p", [0], {"f": [np.arange(1000, dtype=np.int32)]})
            got = c.get("p", [0], ["f"])
            assert np.array_equal(got["f"][0], np.arange(1000, dtype=np.int32))
    with tessera.storage.Server(pool_bytes=32 * mib, pool_chunk_bytes=8 * mib) as u:
        assert u.registered_bytes() == 8 * mib


def test_connection_errors_name_the_address():
    with pytest.raises(ConnectError) as e:
        tessera.storage.Client(units=["127.0.0.1:1"], recv_pool_bytes=1 << 20)
    assert e.value.address == "127.0.0.1:1" and isinstance(e.value, ConnectionError)


def test_tokens_are_checked():
    with tessera.storage.Server(pool_bytes=32 << 20, token="sesame-sesame-sesame") as u:
        with pytest.raises(AuthError) as e:
            tessera.storage.Client(units=[u.address], recv_pool_bytes=1 << 20)
        assert e.value.had_token is False
        with tessera.storage.Client(
            units=[u.address], recv_pool_bytes=1 << 20, token="sesame-sesame-sesame"
        ) as c:
            c.put("p", [0], {"f": [1]})
            assert c.get("p", [0], ["f"]) == {"f": [1]}


def test_server_settings_take_python_units():
    with tessera.storage.Server(
        pool_bytes="64MiB", capacity_bytes=32 << 20, frame_timeout=2.5, handshake_timeout="1s"
    ) as u:
        assert u.stats()["capacity_bytes"] == 32 << 20
    with pytest.raises(tessera.errors.ConfigError, match="unknown field"):
        tessera.storage.Server(no_such_setting=1)


def test_many_concurrent_async_requests(unit):
    async def main():
        async with await tessera.storage.AsyncClient.connect(
            units=[unit.address], recv_pool_bytes=64 << 20
        ) as c:
            rows = [np.full(1000, i, dtype=np.int32) for i in range(200)]
            await asyncio.gather(*(c.put("a", [i], {"x": [rows[i]]}) for i in range(200)))
            got = await asyncio.gather(*(c.get("a", [i], ["x"]) for i in range(200)))
            for i, g in enumerate(got):
                np.testing.assert_array_equal(g["x"][0], rows[i])
            assert len(await c.stats()) == 1
            await c.clear("a", all=True)

    asyncio.run(main())


@pytest.mark.parametrize("busy_poll", [True, False])
def test_polling_and_sleeping_clients_of_a_unit_process(busy_poll):
    # The unit in its own process, with the binary's default polling; this client either
    # polls for its answers (the default) or sleeps until they come, sync and async alike.
    proc, address = tessera.storage.serve_process("--bind", "127.0.0.1:0", "--pool", "64MiB")
    try:
        rows = [np.full(i + 1, i, dtype=np.int64) for i in range(300)]
        with tessera.storage.Client(
            units=[address], recv_pool_bytes=16 << 20, busy_poll=busy_poll
        ) as c:
            for i, row in enumerate(rows):
                c.put("s", [i], {"x": [row]})
                np.testing.assert_array_equal(c.get("s", [i], ["x"])["x"][0], row)

        async def main():
            async with await tessera.storage.AsyncClient.connect(
                units=[address], recv_pool_bytes=16 << 20, busy_poll=busy_poll
            ) as c:
                got = await asyncio.gather(*(c.get("s", [i], ["x"]) for i in range(300)))
                for row, g in zip(rows, got, strict=True):
                    np.testing.assert_array_equal(g["x"][0], row)

        asyncio.run(main())
    finally:
        proc.terminate()
        proc.wait(30)


def test_ctrl_c_during_a_wait_leaves_nothing_leased():
    with tessera.storage.Server(backend="tcp", pool_bytes=512 << 20) as u:
        with tessera.storage.Client(
            units=[u.address], backend="tcp", recv_pool_bytes=512 << 20
        ) as c:
            big = np.ones(192 << 20, dtype=np.uint8)
            c.put("big", [0], {"x": [big]})
            del big
            # Python's own handler, even where this process was started with SIGINT ignored
            # (a background job of a shell), where `interrupt_main` would do nothing.
            previous = signal.signal(signal.SIGINT, signal.default_int_handler)
            timer = threading.Timer(0.2, _thread.interrupt_main)
            try:
                timer.start()
                with pytest.raises(KeyboardInterrupt):
                    for _ in range(200):
                        c.get("big", [0], ["x"])
            finally:
                timer.cancel()
                signal.signal(signal.SIGINT, previous)
            gc.collect()
            deadline = time.monotonic() + 30
            while c.report()["used"] and time.monotonic() < deadline:
                time.sleep(0.05)
            assert c.report()["used"] == 0
            assert c.get("big", [0], ["x"])["x"][0].nbytes == 192 << 20


@pytest.mark.parametrize("backend", ["shm", "tcp"])
def test_two_processes_exchange_tensors(backend):
    import multiprocessing as mp

    import _workers

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    server = ctx.Process(target=_workers.serve_one, args=(child, backend))
    server.start()
    try:
        assert parent.poll(60), "the unit process did not start"
        address = parent.recv()
        with ctx.Pool(1) as pool:
            assert pool.apply(_workers.put_rows, (address, backend, "mp", 6)) == 6
        with tessera.storage.Client(
            units=[address], backend=backend, recv_pool_bytes=64 << 20
        ) as c:
            got = c.get("mp", [0, 5], ["x", "tag"])
        want = np.arange(6 * 1024, dtype=np.float32).reshape(6, 1024)
        np.testing.assert_array_equal(got["x"][1], want[5])
        assert got["tag"] == ["row-0", "row-5"]
    finally:
        parent.send("stop")
        server.join(30)


def test_a_forked_child_cannot_use_the_parents_client(unit):
    c = tessera.storage.Client(units=[unit.address], recv_pool_bytes=8 << 20)
    c.put("f", [0], {"x": [1]})
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            c.get("f", [0], ["x"])
        except ForkedError:
            code = 0
        except BaseException:
            code = 2
        # Dropping the inherited client must not touch the parent's threads (or hang).
        del c
        gc.collect()
        os._exit(code)
    deadline = time.monotonic() + 30
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            pytest.fail("the forked child hung")
        time.sleep(0.02)
    assert os.waitstatus_to_exitcode(status) == 0
    assert c.get("f", [0], ["x"]) == {"x": [1]}
    c.close()


def test_python_m_tessera_storage_runs_the_command_line():
    env = dict(os.environ)
    out = subprocess.run(
        [sys.executable, "-m", "tessera.storage", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert out.returncode == 0 and "serve" in out.stdout
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tessera.storage",
            "serve",
            "--bind",
            "127.0.0.1:0",
            "--pool",
            "64MiB",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("listening "), line
        address = line.split()[1]
        with tessera.storage.Client(units=[address], recv_pool_bytes=1 << 20) as c:
            c.put("cli", [0], {"f": ["ok"]})
            assert c.get("cli", [0], ["f"]) == {"f": ["ok"]}
    finally:
        proc.terminate()
        assert proc.wait(30) == 0
    bad = subprocess.run(
        [sys.executable, "-m", "tessera.storage", "clear", "--unit", "127.0.0.1:1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "--all" in bad.stderr


def test_serve_process_starts_a_unit_and_says_where():
    proc, address = tessera.storage.serve_process(
        "--bind", "127.0.0.1:0", "--pool", "64MiB", token="a-token-of-sixteen-bytes"
    )
    try:
        with tessera.storage.Client(
            units=[address], recv_pool_bytes=1 << 20, token="a-token-of-sixteen-bytes"
        ) as c:
            c.put("sp", [0], {"f": [1]})
            assert c.get("sp", [0], ["f"]) == {"f": [1]}
    finally:
        proc.terminate()
        assert proc.wait(30) == 0
    with pytest.raises(tessera.errors.ServerError, match="did not start"):
        tessera.storage.serve_process("--bind", "256.0.0.1:0")


@pytest.mark.parametrize("placement", ["modulo", "rendezvous"])
def test_replicas_outlive_a_unit_and_lost_values_say_so(placement):
    units = [
        tessera.storage.Server(bind="127.0.0.1:0", backend="shm", pool_bytes=16 << 20)
        for _ in range(3)
    ]
    try:
        with tessera.storage.Client(
            units=[u.address for u in units],
            backend="shm",
            recv_pool_bytes=16 << 20,
            replicas=2,
            placement=placement,
            timeout=10,
        ) as c:
            idx = list(range(60))
            c.put("r", idx, {"x": [np.full(8, i, np.int32) for i in idx]})
            assert sum(s["keys"] for s in c.stats()) == 120
            units[0].close()
            got = c.get("r", idx, ["x"])["x"]
            assert [int(a[0]) for a in got] == idx
            with pytest.raises(StorageError) as e:
                c.put("r", idx, {"x": [np.zeros(8, np.int32)] * 60})
            assert e.value.kind == "replicas" and e.value.units == [0]
            units[1].close()
            with pytest.raises(StorageError) as e:
                c.get("r", idx, ["x"])
            assert e.value.kind == "lost" and e.value.indexes and set(e.value.units) <= {0, 1}
    finally:
        for u in units:
            u.close()
    with pytest.raises(tessera.errors.UsageError, match="replicas"):
        tessera.storage.Client(units=["127.0.0.1:1"], replicas=2)
    with pytest.raises(tessera.errors.ConfigError, match="placement"):
        tessera.storage.Client(units=["127.0.0.1:1"], placement="random")
