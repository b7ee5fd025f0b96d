"""`cargo xtask bench integrations`: the integrations against the backends they replace, each
pair in the same run, interleaved (A B ... B A).

- TransferQueue, two storage units, the client in this process (the units in others): a
  verl-shaped batch (256 samples: `input_ids` and `attention_mask` int64[4096], `log_probs`
  f32[4096], a reward, a jagged `response` of 256..4096 tokens) and one 256 MiB field, through
  SimpleStorage (TransferQueue's default) and Tessera over shm and tcp. MooncakeStore is not
  measured: its wheel is not installed here.
- Ray, two actors: a 1 GiB weight set of 300 tensors (bf16 matrices, f32 norms) and an object
  of 10,000 small views, through TESSERA, Ray's NIXL transport with its CPU memory pool (when
  the `nixl` module imports) and Ray's object store.

CPU seconds per GB are the whole machine's busy time (/proc/stat) over the bytes moved: some
peers busy-poll. Writes OUT/integrations.json and OUT/integrations.md.
"""

from __future__ import annotations

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


def tq_config(name: str, engine: str = "shm") -> dict:
    if name == "SimpleStorage":
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
        tq.close()


# ---------------------------------------------------------------------------------------------
# Ray


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
        if nixl_pool:
            from ray.experimental import register_nixl_memory_pool

            register_nixl_memory_pool(2 << 30, "cpu")

    def ready(self):
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
        return self.views_list


HOLDERS = {"TESSERA": TesseraHolder, "NIXL": NixlHolder, None: StoreHolder}


@ray.remote(num_cpus=0)
class Sink:
    def take(self, tensors):
        return len(tensors)


def ray_run(label: str, transport: str | None, metrics: dict, cpu: dict) -> None:
    holder = HOLDERS[transport].remote(nixl_pool=transport == "NIXL")
    sink = Sink.remote()
    ray.get(holder.ready.remote())
    nbytes = sum(t.numel() * t.element_size() for t in weight_set())

    def one_g():
        assert ray.get(sink.take.remote(holder.weights_.remote())) == 300

    def ten_k():
        assert ray.get(sink.take.remote(holder.views.remote())) == 10_000

    one_g()
    ten_k()
    t_1g = []
    cpu0 = busy_seconds()
    for _ in range(3):
        t = time.perf_counter()
        one_g()
        t_1g.append(time.perf_counter() - t)
    cpu[f"ray_{label}_1g_cpu_s_per_gb"] = (busy_seconds() - cpu0) / (3 * nbytes / 1e9)
    t_10k = []
    for _ in range(5):
        t = time.perf_counter()
        ten_k()
        t_10k.append(time.perf_counter() - t)
    metrics[f"ray_{label}_1g_s"] = min(metrics.get(f"ray_{label}_1g_s", 1e9), min(t_1g))
    metrics[f"ray_{label}_10k_views_ms"] = min(
        metrics.get(f"ray_{label}_10k_views_ms", 1e9), statistics.median(t_10k) * 1e3
    )
    ray.kill(holder)
    ray.kill(sink)


def main() -> None:
    out_dir = Path(sys.argv[1] if len(sys.argv) > 1 else "target/tessera-bench")
    out_dir.mkdir(parents=True, exist_ok=True)
    metrics: dict[str, float] = {}
    cpu: dict[str, float] = {}
    # Logical CPUs: SimpleStorage's units and TransferQueue's controller ask for one each.
    # Pools for two 1 GiB objects at once: Ray frees an object's blocks (garbage_collect) only
    # some time after its last reference is gone, when the next object may already be put.
    pools = {
        k: str(3 << 30) for k in ("TESSERA_RAY_SEND_POOL_BYTES", "TESSERA_RAY_RECV_POOL_BYTES")
    }
    ray.init(
        num_cpus=8,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": pools},
    )
    try:
        order = [
            ("simple", "SimpleStorage", "shm"),
            ("tessera_shm", "Tessera", "shm"),
            ("tessera_tcp", "Tessera", "tcp"),
        ]
        for label, name, engine in order + order[::-1]:
            tq_run(label, tq_config(name, engine), metrics, cpu)
        transports = [("tessera", "TESSERA"), ("object_store", None)]
        try:
            import nixl._api  # noqa: F401

            transports.insert(1, ("nixl", "NIXL"))
        except ImportError:
            pass
        for label, transport in transports + transports[::-1]:
            try:
                ray_run(label, transport, metrics, cpu)
            except Exception as e:  # one transport's failure is a figure too
                print(f"ray {label}: {type(e).__name__}: {str(e).splitlines()[0]}", file=sys.stderr)
                metrics[f"ray_{label}_failed"] = 1.0
    finally:
        ray.shutdown()

    for op in ("batch_put", "batch_get", "256m_put", "256m_get"):
        metrics[f"tq_tessera_vs_simple_{op}"] = (
            metrics[f"tq_tessera_shm_{op}_gbps"] / metrics[f"tq_simple_{op}_gbps"]
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
