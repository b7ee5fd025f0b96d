"""Runs TransferQueue's own end-to-end tests against the Tessera backend, their files as
installed::

    TQ_TEST_BACKEND=Tessera pytest -p tessera.integrations.transfer_queue.pytest_plugin \\
        .../site-packages/tests/e2e/test_kv_interface_e2e.py

The test modules choose their backend's configuration from a module-level ``BACKEND_CONFIGS``
table, read when their fixtures set up; this plugin adds a ``Tessera`` entry to every collected
module that has the table (the modules are imported by file name, so the entry goes into the
module objects pytest collected), and registers the backend in this process.
"""

from __future__ import annotations

import copy
import os

# Two units on shm, started by the bootstrap provider; Ray actors would take no CPU either, but
# processes keep the units out of the Ray cluster the tests start and stop per module.
TESSERA_CONFIG = {
    "controller": {"polling_mode": True},
    "backend": {
        "storage_backend": "Tessera",
        "Tessera": {
            "num_units": 2,
            "launch": "process",
            "backend": "shm",
            "pool_bytes": 256 << 20,
            "capacity_bytes": 128 << 20,
            "recv_pool_bytes": 128 << 20,
        },
    },
}


def pytest_configure(config) -> None:
    os.environ.setdefault("TQ_TEST_BACKEND", "Tessera")
    import tessera.integrations.transfer_queue  # noqa: F401  (registers the backend here)


def pytest_collection_modifyitems(session, config, items) -> None:
    modules = {id(m): m for m in (getattr(i, "module", None) for i in items) if m is not None}
    for module in modules.values():
        table = getattr(module, "BACKEND_CONFIGS", None)
        if isinstance(table, dict):
            table.setdefault("Tessera", copy.deepcopy(TESSERA_CONFIG))
