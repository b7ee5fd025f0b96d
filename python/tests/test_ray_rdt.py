import gc
import os
import time

import pytest

ray = pytest.importorskip("ray")
torch = pytest.importorskip("torch")

import tessera.integrations.ray as tray  # noqa: E402


@pytest.fixture(scope="module")
def cluster():
    here = os.path.dirname(os.path.abspath(__file__))
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        runtime_env={"env_vars": {"PYTHONPATH": here}},
        log_to_driver=False,
    )
    import _ray_actors

    yield _ray_actors
    ray.shutdown()


def eventually(fn, timeout=30):
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.1)


def test_registration_is_idempotent():
    tray.register()
    tray.register()
    from ray.experimental.rdt.util import transport_manager_info

    assert "TESSERA" in transport_manager_info


def test_actor_to_actor_and_to_the_driver(cluster):
    p, c = cluster.Producer.remote(), cluster.Consumer.remote()
    ref = p.make.remote(1000, 3)
    assert ray.get(c.sums.remote(ref), timeout=60) == [0.0, 1000.0, 2000.0]
    got = ray.get(ref, timeout=60)
    assert [t.shape for t in got] == [torch.Size([1000])] * 3 and got[2][0].item() == 2.0
    del ref, got
    gc.collect()
    # The sender frees the object's blocks once Ray has collected it.
    assert eventually(lambda: ray.get(p.sender_report.remote())["used"] == 0)


def test_zero_size_and_bf16_tensors(cluster):
    p, c = cluster.Producer.remote(), cluster.Consumer.remote()
    ref = p.empty.remote()
    assert ray.get(c.sums.remote(ref), timeout=60) == [0.0, 3.0]


def test_ray_put_from_the_driver(cluster):
    c = cluster.Consumer.remote()
    t = torch.arange(4096, dtype=torch.float32)
    ref = ray.put([t, t * 2], _tensor_transport="TESSERA")
    assert ray.get(c.sums.remote(ref), timeout=60) == [float(t.sum()), float(t.sum() * 2)]
    # The receiver's views are gone with the call: its blocks are back.
    assert eventually(lambda: ray.get(c.receiver_report.remote())["used"] == 0)


def test_mixed_dtypes(cluster):
    p, c = cluster.Producer.remote(), cluster.Consumer.remote()
    got = ray.get(c.describe.remote(p.mixed.remote()), timeout=60)
    assert got == [
        ("torch.bfloat16", (4, 4)),
        ("torch.int64", (10,)),
        ("torch.bool", (2,)),
        ("torch.complex64", (3,)),
        ("torch.float8_e4m3fn", (2,)),
    ]


def test_ten_thousand_views(cluster):
    p, c = cluster.Producer.remote(), cluster.Consumer.remote()
    assert ray.get(c.count_and_check.remote(p.views.remote(10_000)), timeout=120) == (10_000, True)


def _exited(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            # The state follows the parenthesised command name; a zombie has exited.
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def test_a_sender_killed_before_the_fetch_fails_it_and_frees_the_blocks(cluster):
    p, c = cluster.Producer.remote(), cluster.Consumer.remote()
    ref = p.make.remote(1 << 20, 2)
    ray.wait([ref], timeout=60)
    pid = ray.get(p.pid.remote(), timeout=60)
    ray.kill(p)
    # ray.kill returns before the actor's process is gone, and a fetch that starts while it
    # still runs succeeds: wait for the exit so that the fetch meets a dead sender.
    assert eventually(lambda: _exited(pid))
    with pytest.raises(Exception):  # noqa: B017  (Ray wraps the transfer error its own way)
        ray.get(c.sums.remote(ref), timeout=60)
    assert eventually(lambda: (ray.get(c.receiver_report.remote()) or {"used": 0})["used"] == 0)


def test_target_buffers_receive_the_tensors_in_place(cluster):
    from ray.experimental import set_target_for_ref

    p = cluster.Producer.remote()
    ref = p.make.remote(1000, 3)
    into = [torch.empty(1000) for _ in range(3)]
    set_target_for_ref(ref, into)
    got = ray.get(ref, timeout=60)
    assert [t.data_ptr() for t in got] == [t.data_ptr() for t in into]
    assert [t[0].item() for t in into] == [0.0, 1.0, 2.0]
    assert all(bool((t == t[0]).all()) for t in into)


def test_transfer_queue_units_as_ray_actors(cluster):
    pytest.importorskip("transfer_queue")
    from tessera.integrations import transfer_queue as ttq

    s = ttq.settings({"launch": "ray", "pool_bytes": 64 << 20, "capacity_bytes": 32 << 20})
    units = ttq.start_units(s)
    try:
        assert len(units) == 2 and len(set(units)) == 2
        kv = ttq.TesseraStorageClient({"units": units, "recv_pool_bytes": 16 << 20})
        try:
            kv.put(["0@x", "1@x"], [torch.arange(3), torch.arange(4)])
            got = kv.get(["1@x", "0@x"])
            assert torch.equal(got[0], torch.arange(4)) and torch.equal(got[1], torch.arange(3))
            # Indexes 0 and 1 live on different units.
            assert [u["keys"] for u in kv.client.stats()] == [1, 1]
        finally:
            kv.close()
        actors = ttq._STARTED[-2:]
    finally:
        ttq.stop_units()
    for actor in actors:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(actor.address.remote(), timeout=60)
