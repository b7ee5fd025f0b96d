"""`cargo xtask bench python`: the Python package against the Rust client, in one run.

Each Python figure is taken beside its Rust reference: the same operation through the same
client (or agent) from this process, against the same unit, with the values made in Rust
(`tessera._native._bench_*`). The unit runs in its own process (`python -m tessera.storage
serve`, with the binary's default busy polling), pinned to the last cpu, this process to the
first, as the Rust storage suite does. Clients poll for their answers (the default) except
where a figure says otherwise.
Writes OUT/python.json (flat metrics) and OUT/python.md (the table).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

import tessera
from tessera import _native

MIB = 1 << 20


def best(xs):
    return min(xs)


def timed(fn, iters):
    out = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def start_unit(cpu: int | None):
    def pin():
        if cpu is not None:
            os.sched_setaffinity(0, {cpu})

    return tessera.storage.serve_process(
        "--bind", "127.0.0.1:0", "--pool", "1536MiB", "--capacity", "1GiB", preexec_fn=pin
    )


def main() -> None:
    out_dir = Path(sys.argv[1] if len(sys.argv) > 1 else "target/tessera-bench")
    out_dir.mkdir(parents=True, exist_ok=True)
    cpus = sorted(os.sched_getaffinity(0))
    unit_cpu = cpus[-1] if len(cpus) > 1 else None
    if len(cpus) > 1:
        os.sched_setaffinity(0, {cpus[0]})
    torch.set_num_threads(1)
    proc, address = start_unit(unit_cpu)
    metrics: dict[str, float] = {}
    how: dict[str, str] = {}
    try:
        with tessera.storage.Client(
            units=[address], backend="shm", recv_pool_bytes=768 * MIB, tensor_type="torch"
        ) as c:
            native = c._native
            big = torch.ones(256 * MIB, dtype=torch.uint8)
            py_put = best(timed(lambda: c.put("big", [0], {"x": [big]}), 5))
            rust_put = best(_native._bench_put(native, "big-rust", 1, 256 * MIB, 5))

            def get_big():
                got = c.get("big", [0], ["x"])
                del got

            py_get = best(timed(get_big, 5))
            rust_get = best(_native._bench_get(native, "big-rust", 1, 5))
            gb = 256 * MIB / 1e9
            metrics["py_put_256m_gbps"] = gb / py_put
            metrics["py_get_256m_gbps"] = gb / py_get
            metrics["py_vs_rust_put"] = rust_put / py_put
            metrics["py_vs_rust_get"] = rust_get / py_get
            how["py_put_256m_gbps"] = "PUT of one 256 MiB torch tensor over shm, best of 5"
            how["py_get_256m_gbps"] = (
                "GET of it as a torch tensor (a view of the receive pool), best of 5"
            )
            how["py_vs_rust_put"] = (
                "the Rust client's PUT of a 256 MiB Rust buffer, same client, / the Python PUT (goal >= 0.9)"
            )
            how["py_vs_rust_get"] = "the Rust client's GET of it / the Python GET (goal >= 0.9)"
            c.clear("big", all=True)
            c.clear("big-rust", all=True)
            big = None

            rows = [torch.full((1024,), i, dtype=torch.float32) for i in range(1000)]
            idx = list(range(1000))
            py_batch = best(timed(lambda: c.put("batch", idx, {"x": rows}), 20))
            rust_batch = best(_native._bench_put(native, "batch-rust", 1000, 4096, 20))
            metrics["py_batch_put_gbps"] = 1000 * 4096 / 1e9 / py_batch
            metrics["py_batch_put_vs_rust"] = rust_batch / py_batch
            how["py_batch_put_gbps"] = (
                "PUT of 1,000 separate 4 KiB torch tensors in one request, best of 20"
            )
            how["py_batch_put_vs_rust"] = "the Rust client's PUT of 1,000 x 4 KiB / the Python one"

            tiny = torch.ones(1, dtype=torch.float32)
            py_small = statistics.median(timed(lambda: c.put("small", [0], {"x": [tiny]}), 2000))
            rust_small = statistics.median(_native._bench_put(native, "small-rust", 1, 4, 2000))
            metrics["py_small_put_us"] = py_small * 1e6
            metrics["py_small_put_vs_rust"] = py_small / rust_small
            how["py_small_put_us"] = "round trip of a 4-byte torch tensor PUT, median of 2000"
            how["py_small_put_vs_rust"] = (
                "py_small_put_us / the Rust client's 4-byte PUT (goal <= 1.5)"
            )

        # A client that sleeps while it waits for an answer (busy_poll=False).
        with tessera.storage.Client(
            units=[address], backend="shm", recv_pool_bytes=64 * MIB, busy_poll=False
        ) as c:
            unpolled = statistics.median(timed(lambda: c.put("small", [0], {"x": [tiny]}), 2000))
            metrics["py_small_put_unpolled_us"] = unpolled * 1e6
            metrics["py_small_put_vs_unpolled"] = py_small / unpolled
            how["py_small_put_unpolled_us"] = "py_small_put_us with busy_poll=False"
            how["py_small_put_vs_unpolled"] = "py_small_put_us / py_small_put_unpolled_us"

        a = tessera.Agent("bench-sender", backend="shm")
        b = tessera.Agent("bench-receiver", backend="shm")
        peer = b.add_remote(a.metadata())
        sender = tessera.rdt.SenderPool(a, capacity=64 * MIB)
        receiver = tessera.rdt.ReceiverPool(b, capacity=64 * MIB, tensor_type="torch")
        weights = torch.arange(10_000 * 16, dtype=torch.float32)
        views = list(weights.split(16))

        def pool_put():
            sender.put("w", views)

        py_pool = statistics.median(timed(pool_put, 20))
        desc = sender.put("w", views)

        def pool_fetch():
            got = receiver.fetch(desc, peer)
            del got

        py_fetch = statistics.median(timed(pool_fetch, 20))
        rust_pool = statistics.median(_native._bench_pool_put(a, 10_000, 64, 20))
        metrics["py_pool_put_10k_us"] = py_pool * 1e6
        metrics["py_pool_fetch_10k_us"] = py_fetch * 1e6
        metrics["py_pool_put_vs_rust"] = py_pool / rust_pool
        how["py_pool_put_10k_us"] = (
            "SenderPool.put of 10,000 views (16 float32 each) of one torch tensor, median of 20 (goal <= 5,000; Ray's Python pool: 28,000)"
        )
        how["py_pool_fetch_10k_us"] = "ReceiverPool.fetch of them as torch tensors, median of 20"
        how["py_pool_put_vs_rust"] = (
            "py_pool_put_10k_us / the Rust SenderPool.put of 10,000 views of a Rust buffer"
        )
    finally:
        proc.terminate()
        proc.wait(30)

    (out_dir / "python.json").write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
    lines = ["### python", "", "| metric | value | how it was taken |", "|---|---:|---|"]
    for k, v in metrics.items():
        lines.append(f"| `{k}` | {v:.3f} | {how[k]} |")
    table = "\n".join(lines) + "\n"
    (out_dir / "python.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
