"""`cargo xtask bench integrations`: the integrations against the backends they replace, each
pair in the same run, interleaved (A B ... B A).

- TransferQueue, two storage units, the client in this process (the units in others): a
  verl-shaped batch (256 samples: `input_ids` and `attention_mask` int64[4096], `log_probs`
  f32[4096], a reward, a jagged `response` of 256..4096 tokens) and one 256 MiB field, through
  SimpleStorage (TransferQueue's default) and Tessera over shm and tcp, beside `Floor`: a
  backend that keeps values in the client's memory, whose figures are TransferQueue's own
  cost, the ceiling of any backend, and MooncakeStore over TCP (its CPU wheel,
  `mooncake-transfer-engine-non-cuda`; its master needs `libibverbs1`). Its one client stores
  into the segment it contributed itself, in its own process, so Tessera over shm is the
  figure it is compared with.
- Ray, two actors: a 1 GiB weight set of 300 tensors (bf16 matrices, f32 norms) and an object
  of 10,000 small views, through TESSERA, Ray's NIXL transport with its CPU memory pool (when
  the `nixl` module imports) and Ray's object store.

CPU seconds per GB are the whole machine's busy time (/proc/stat) over the bytes moved: some
peers busy-poll. Writes OUT/integrations.json and OUT/integrations.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import ray
import torch

import tessera.integrations.ray
import tessera.integrations.transfer_queue  # noqa: F401  (the Tessera storage backend)

MIB = 1 << 20
# NIXL's UCX in the actors: no InfiniBand probing, network transports on loopback only (the
# project's test settings; shared memory between the actors stays available).
UCX_ENV = {k: os.environ.get(k, v) for k, v in (("UCX_MODULES", "^ib"), ("UCX_NET_DEVICES", "lo"))}
TICK = os.sysconf("SC_CLK_TCK")


def busy_seconds() -> float:
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / TICK


def measure(fn, iters: int, nbytes: int) -> tuple[float, float]:
    """(best GB/s, CPU seconds per GB) of `iters` calls of `fn`."""
    times = []
    cpu0 = busy_seconds()
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    cpu = busy_seconds() - cpu0
    return nbytes / 1e9 / min(times), cpu / (nbytes * iters / 1e9)


# ---------------------------------------------------------------------------------------------
# TransferQueue


def verl_batch(n: int = 256):
    from tensordict import TensorDict

    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(256, 4097, (n,), generator=g).tolist()
    response = torch.nested.nested_tensor(
        [torch.randint(0, 32000, (k,), generator=g) for k in lengths], layout=torch.jagged
    )
    td = TensorDict(
        {
            "input_ids": torch.randint(0, 32000, (n, 4096), generator=g),
            "attention_mask": torch.ones(n, 4096, dtype=torch.int64),
            "log_probs": torch.randn(n, 4096, generator=g),
            "reward": torch.randn(n, generator=g),
            "response": response,
        },
        batch_size=[n],
    )
    nbytes = n * 4096 * (8 + 8 + 4) + n * 4 + sum(lengths) * 8
    return td, nbytes


def register_floor() -> None:
    """A TransferQueue backend named ``Floor`` that keeps values in the client's own memory:
    no storage, no transfer, no copy. What it measures is TransferQueue's own work around a
    backend (metadata, the controller, splitting and stacking the batch), the ceiling of
    every backend's figure through TransferQueue's API."""
    from transfer_queue.storage.bootstrap.provider import StorageBootstrapProvider
    from transfer_queue.storage.clients.base import StorageClientFactory, StorageKVClient
    from transfer_queue.storage.managers.base import KVStorageManager, StorageManagerFactory

    store: dict[str, object] = {}

    @StorageClientFactory.register("FloorClient")
    class FloorClient(StorageKVClient):
        def put(self, keys, values):
            store.update(zip(keys, values, strict=True))

        def get(self, keys, shapes=None, dtypes=None, custom_backend_meta=None):
            return [store[k] for k in keys]

        def clear(self, keys, custom_backend_meta=None):
            for k in keys:
                store.pop(k, None)

    @StorageManagerFactory.register("Floor")
    class FloorManager(KVStorageManager):
        def __init__(self, controller_info, config, zmq_context=None):
            config["client_name"] = "FloorClient"
            super().__init__(controller_info, config, zmq_context=zmq_context)

    StorageBootstrapProvider.register_provider("Floor")(lambda conf: ["in-process"])


def tq_config(name: str, engine: str = "shm") -> dict:
    if name == "Floor":
        section = {}
    elif name == "MooncakeStore":
        # Its master (started by TransferQueue's bootstrap, from .venv/bin) and this client's
        # segment; over TCP, as the CPU build runs here.
        section = {
            "global_segment_size": 1024 * MIB,
            "local_buffer_size": 1024 * MIB,
            "metadata_server": "127.0.0.1:50050",
            "master_server_address": "127.0.0.1:50051",
            "protocol": "tcp",
            "device_name": "",
        }
    elif name == "SimpleStorage":
        section = {"total_storage_size": 4096, "num_data_storage_units": 2}
    else:
        section = {
            "num_units": 2,
            "backend": engine,
            "pool_bytes": 1536 * MIB,
            "capacity_bytes": 1024 * MIB,
            "recv_pool_bytes": 1024 * MIB,
        }
    return {
        "controller": {"polling_mode": True},
        "backend": {"storage_backend": name, name: section},
    }


def tq_run(label: str, config: dict, metrics: dict, cpu: dict) -> None:
    import transfer_queue as tq
    from omegaconf import OmegaConf
    from tensordict import TensorDict

    tq.init(OmegaConf.create(config))
    try:
        batch, nbytes = verl_batch()
        keys = [f"s{i}" for i in range(batch.batch_size[0])]

        def put():
            tq.kv_batch_put(keys=keys, partition_id="bench", fields=batch)

        def get():
            got = tq.kv_batch_get(keys=keys, partition_id="bench")
            del got

        put()
        for op, fn in (("batch_put", put), ("batch_get", get)):
            gbps, cpg = measure(fn, 5, nbytes)
            metrics[f"tq_{label}_{op}_gbps"] = max(metrics.get(f"tq_{label}_{op}_gbps", 0), gbps)
            cpu[f"tq_{label}_{op}_cpu_s_per_gb"] = cpg
        tq.kv_clear(keys=keys, partition_id="bench")
        big = TensorDict({"w": torch.ones(1, 256 * MIB, dtype=torch.uint8)}, batch_size=[1])

        def put_big():
            tq.kv_batch_put(keys=["big"], partition_id="bench", fields=big)

        def get_big():
            got = tq.kv_batch_get(keys=["big"], partition_id="bench")
            del got

        put_big()
        for op, fn in (("256m_put", put_big), ("256m_get", get_big)):
            gbps, cpg = measure(fn, 3, 256 * MIB)
            metrics[f"tq_{label}_{op}_gbps"] = max(metrics.get(f"tq_{label}_{op}_gbps", 0), gbps)
            cpu[f"tq_{label}_{op}_cpu_s_per_gb"] = cpg
        tq.kv_clear(keys=["big"], partition_id="bench")
    finally:
        from transfer_queue import interface

        # TransferQueue leaves MooncakeStore's master running ("consider manually killing"):
        # it is this run's, stopped here.
        started = (getattr(interface, "_TQ_STORAGE", None) or {}).get("MooncakeStore")
        tq.close()
        for proc in started if isinstance(started, dict) else [started]:
            if hasattr(proc, "terminate"):
                proc.terminate()
                proc.wait(30)


# ---------------------------------------------------------------------------------------------
# Ray


# 100 layers of two bf16 1024 x 2560 matrices and an f32 norm of 1024.
WEIGHT_BYTES = 100 * (2 * 1024 * 2560 * 2 + 1024 * 4)


def weight_set():
    torch.manual_seed(0)
    tensors = []
    # 100 layers: two bf16 matrices and a norm each, about 1 GiB in all.
    for _ in range(100):
        tensors.append(torch.randn(1024, 2560).to(torch.bfloat16))
        tensors.append(torch.randn(2560, 1024).to(torch.bfloat16))
        tensors.append(torch.randn(1024))
    return tensors


class _Holder:
    """Holds a weight set and 10,000 views, and returns them through one transport."""

    def __init__(self, nixl_pool: bool = False):
        self.weights = weight_set()
        base = torch.arange(10_000 * 16, dtype=torch.float32)
        self.views_list = list(base.split(16))
        # Pickled for the object store, a view carries its whole storage (10,000 views would
        # be 10,000 copies of the 640 KB base): that path gets tensors of their own.
        self.own_views = [v.clone() for v in self.views_list]
        if nixl_pool:
            from ray.experimental import register_nixl_memory_pool

            register_nixl_memory_pool(2 << 30, "cpu")

    def ready(self):
        return True

    def pid(self):
        return os.getpid()

    def settle(self):
        """Returns once Ray has let go of every object made of these tensors (a tensor
        transport frees an object's memory some time after its last reference is gone)."""
        from ray.experimental import wait_tensor_freed

        for t in (self.weights[0], self.views_list[0]):
            wait_tensor_freed(t, timeout=120)
        return True


@ray.remote(num_cpus=0)
class TesseraHolder(_Holder):
    @ray.method(tensor_transport="TESSERA")
    def weights_(self):
        return self.weights

    @ray.method(tensor_transport="TESSERA")
    def views(self):
        return self.views_list


@ray.remote(num_cpus=0)
class NixlHolder(_Holder):
    @ray.method(tensor_transport="NIXL")
    def weights_(self):
        return self.weights

    @ray.method(tensor_transport="NIXL")
    def views(self):
        return self.views_list


@ray.remote(num_cpus=0)
class StoreHolder(_Holder):
    def weights_(self):
        return self.weights

    def views(self):
        return self.own_views


HOLDERS = {"TESSERA": TesseraHolder, "NIXL": NixlHolder, None: StoreHolder}


# A receiver of RDT objects needs the tensor transport too: Ray runs its receives on the
# actor's system thread, which a plain actor lacks (a receive queued behind the task that
# waits for it would wait out Ray's RDT timeout).
@ray.remote(num_cpus=0, enable_tensor_transport=True)
class Sink:
    def take(self, tensors):
        return len(tensors)

    def pid(self):
        return os.getpid()


def ray_run(label: str, transport: str | None, metrics: dict, cpu: dict) -> None:
    holder = HOLDERS[transport].remote(nixl_pool=transport == "NIXL")
    sink = Sink.remote()
    ray.get(holder.ready.remote())
    nbytes = WEIGHT_BYTES

    def one_g():
        assert ray.get(sink.take.remote(holder.weights_.remote())) == 300

    def ten_k():
        assert ray.get(sink.take.remote(holder.views.remote())) == 10_000

    def timed(fn, iters):
        """Each call's time, and the CPU seconds of the calls; the holder settles between
        calls, untimed, so one object's memory is never held while the next is sent."""
        times, busy = [], 0.0
        for _ in range(iters):
            cpu0, t = busy_seconds(), time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
            busy += busy_seconds() - cpu0
            gc.collect()
            if transport is not None:
                ray.get(holder.settle.remote())
        return times, busy

    timed(one_g, 1)
    timed(ten_k, 1)
    t_1g, busy = timed(one_g, 3)
    cpu[f"ray_{label}_1g_cpu_s_per_gb"] = busy / (3 * nbytes / 1e9)
    t_10k, _ = timed(ten_k, 5)
    metrics[f"ray_{label}_1g_s"] = min(metrics.get(f"ray_{label}_1g_s", 1e9), min(t_1g))
    metrics[f"ray_{label}_10k_views_ms"] = min(
        metrics.get(f"ray_{label}_10k_views_ms", 1e9), statistics.median(t_10k) * 1e3
    )
    pids = ray.get([holder.pid.remote(), sink.pid.remote()])
    for actor in (holder, sink):
        ray.kill(actor)
    # Killing is asynchronous: wait until both processes are gone, with their memory.
    deadline = time.monotonic() + 60
    while any(os.path.exists(f"/proc/{pid}") for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", nargs="?", default="target/tessera-bench", type=Path)
    parser.add_argument(
        "--only", choices=("tq", "ray"), help="one half: TransferQueue's backends or Ray's"
    )
    args = parser.parse_args()
    out_dir = args.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    metrics: dict[str, float] = {}
    cpu: dict[str, float] = {}
    # Logical CPUs: SimpleStorage's units and TransferQueue's controller ask for one each.
    # Pools for one 1 GiB object with room to spare: the holders settle between calls.
    pools = {
        k: str(3 << 29) for k in ("TESSERA_RAY_SEND_POOL_BYTES", "TESSERA_RAY_RECV_POOL_BYTES")
    }
    ray.init(
        num_cpus=8,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {**pools, **UCX_ENV}},
    )
    try:
        register_floor()
        # MooncakeStore's master comes from its wheel's .venv/bin.
        os.environ["PATH"] = f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"
        order = [
            ("floor", "Floor", "shm"),
            ("simple", "SimpleStorage", "shm"),
            ("mooncake", "MooncakeStore", "tcp"),
            ("tessera_shm", "Tessera", "shm"),
            ("tessera_tcp", "Tessera", "tcp"),
        ]
        for label, name, engine in order + order[::-1] if args.only != "ray" else []:
            tq_run(label, tq_config(name, engine), metrics, cpu)
        transports = [("tessera", "TESSERA"), ("object_store", None)]
        try:
            import nixl._api  # noqa: F401

            transports.insert(1, ("nixl", "NIXL"))
        except ImportError:
            pass
        for label, transport in transports + transports[::-1] if args.only != "tq" else []:
            try:
                ray_run(label, transport, metrics, cpu)
            except Exception as e:  # one transport's failure is a figure too
                print(f"ray {label}: {type(e).__name__}: {str(e).splitlines()[0]}", file=sys.stderr)
                metrics[f"ray_{label}_failed"] = 1.0
    finally:
        ray.shutdown()

    for op in ("batch_put", "batch_get", "256m_put", "256m_get") if args.only != "ray" else []:
        metrics[f"tq_tessera_vs_simple_{op}"] = (
            metrics[f"tq_tessera_shm_{op}_gbps"] / metrics[f"tq_simple_{op}_gbps"]
        )
        # The most any backend could gain over SimpleStorage through TransferQueue's API.
        metrics[f"tq_floor_vs_simple_{op}"] = (
            metrics[f"tq_floor_{op}_gbps"] / metrics[f"tq_simple_{op}_gbps"]
        )
        # MooncakeStore's one client here stores into the segment it contributed itself, in
        # its own process: Tessera's same-host engine is the fair match.
        metrics[f"tq_tessera_vs_mooncake_{op}"] = (
            metrics[f"tq_tessera_shm_{op}_gbps"] / metrics[f"tq_mooncake_{op}_gbps"]
        )
    if "ray_nixl_1g_s" in metrics and "ray_tessera_1g_s" in metrics:
        metrics["ray_tessera_vs_nixl_1g"] = metrics["ray_nixl_1g_s"] / metrics["ray_tessera_1g_s"]
        metrics["ray_tessera_vs_nixl_10k"] = (
            metrics["ray_nixl_10k_views_ms"] / metrics["ray_tessera_10k_views_ms"]
        )
    metrics.update(cpu)
    (out_dir / "integrations.json").write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
    lines = ["### integrations", "", "| metric | value |", "|---|---:|"]
    lines += [f"| `{k}` | {v:.3f} |" for k, v in sorted(metrics.items())]
    table = "\n".join(lines) + "\n"
    (out_dir / "integrations.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
