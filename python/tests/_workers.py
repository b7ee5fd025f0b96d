"""Functions the multiprocessing tests run in spawned children (importable by name)."""

import numpy as np

import tessera


def put_rows(address: str, backend: str, partition: str, rows: int) -> int:
    with tessera.storage.Client(units=[address], backend=backend, recv_pool_bytes=64 << 20) as c:
        data = np.arange(rows * 1024, dtype=np.float32).reshape(rows, 1024)
        c.put(partition, list(range(rows)), {"x": data, "tag": [f"row-{i}" for i in range(rows)]})
    return rows


def serve_one(conn, backend: str) -> None:
    """Serves a unit and says its address through `conn`; stops when the parent says so."""
    with tessera.storage.Server(bind="127.0.0.1:0", backend=backend, pool_bytes=64 << 20) as u:
        conn.send(u.address)
        conn.recv()
