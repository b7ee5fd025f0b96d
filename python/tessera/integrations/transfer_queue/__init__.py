"""TransferQueue's storage on Tessera units: ``backend.storage_backend: Tessera``.

Importing this module registers, in this process, a storage manager named ``Tessera``, its
key-value client and a bootstrap provider::

    import tessera.integrations.transfer_queue  # noqa: F401  (registers "Tessera")
    import transfer_queue as tq
    from omegaconf import OmegaConf

    tq.init(OmegaConf.create({"backend": {"storage_backend": "Tessera",
                                          "Tessera": {"num_units": 2, "backend": "shm"}}}))

The ``backend.Tessera`` section (it must be present, even empty):

- ``units``: addresses of running units (``tessera-storage serve`` or
  ``python -m tessera.storage serve``); when empty, the provider starts ``num_units`` units;
- ``num_units`` (2), ``launch`` (``"process"``: child processes of the process that called
  ``tq.init``; ``"ray"``: Ray actors that take no CPU), ``pool_bytes`` (512 MiB) and
  ``capacity_bytes`` (256 MiB) of each unit it starts;
- ``backend`` (``"shm"``; ``"tcp"`` across hosts), ``token``, ``recv_pool_bytes`` (256 MiB per
  client), ``timeout`` (60 s), ``partition`` (``"tq"``).

Workers: ``tq.init()`` in a worker rebuilds the manager from the controller's copy of the
configuration. The provider puts an object of this module into that configuration, so
unpickling it in the worker imports this module, which registers the backend there: a worker
needs ``tessera`` installed, nothing more.

Values: tensors travel zero-copy from the caller's memory (a non-contiguous one, such as a row
of a nested tensor's strided view, is copied once and counted in ``tessera.copies()``). GET
results are views of the client's receive pool, independent of the units' memory; TransferQueue
itself then copies them when it stacks them into a TensorDict or a nested tensor (its
``_merge_tensors_to_tensordict``): one copy per GET, TransferQueue's. Non-tensor values
(strings, lists, dicts, NumPy object and bytes values, ...) are pickled into ``bytes`` values.
"""

from __future__ import annotations

import atexit
import pickle
import subprocess
import threading
import time
from collections import defaultdict
from typing import Any

import torch
from transfer_queue.storage.bootstrap.provider import StorageBootstrapProvider
from transfer_queue.storage.clients.base import StorageClientFactory, StorageKVClient
from transfer_queue.storage.managers.base import KVStorageManager, StorageManagerFactory

import tessera

NAME = "Tessera"
CLIENT_NAME = "TesseraStorageClient"

DEFAULTS: dict[str, Any] = {
    "units": None,
    "num_units": 2,
    "launch": "process",
    "backend": "shm",
    "pool_bytes": 512 << 20,
    "capacity_bytes": 256 << 20,
    "recv_pool_bytes": 256 << 20,
    "token": None,
    "timeout": 60.0,
    "partition": "tq",
}


def settings(config: Any) -> dict[str, Any]:
    """The ``backend.Tessera`` section with defaults, as plain Python values."""
    out = dict(DEFAULTS)
    if config is not None:
        try:
            from omegaconf import OmegaConf

            if OmegaConf.is_config(config):
                config = OmegaConf.to_container(config, resolve=True)
        except ImportError:
            pass
        out.update({k: v for k, v in dict(config).items() if v is not None})
    return out


class Registered:
    """Put into ``backend.Tessera`` by the provider: unpickling it (``tq.init()`` in a worker
    fetches the configuration from the controller) imports this module, which registers the
    backend in that process."""

    def __reduce__(self):
        return (Registered, ())

    def __repr__(self) -> str:
        return "tessera.integrations.transfer_queue.Registered()"


def _split(keys: list[str]) -> list[tuple[int, str]]:
    out = []
    for k in keys:
        index, sep, field = k.partition("@")
        if not sep or not index.isdigit():
            raise tessera.errors.UsageError(f"a TransferQueue key is 'index@field', not {k!r}")
        out.append((int(index), field))
    return out


@StorageClientFactory.register(CLIENT_NAME)
class TesseraStorageClient(StorageKVClient):
    """TransferQueue's key-value client on Tessera units; keys ``index@field`` are index
    ``index``, field ``field`` of one partition (``partition``, default ``"tq"``), placed on
    unit ``index % len(units)``. Safe to call from several threads."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        s = settings(config)
        units = s["units"]
        if not units:
            raise tessera.errors.ConfigError(
                "backend.Tessera has no units: start them with the Tessera bootstrap provider "
                "(transfer_queue.init) or list running units in backend.Tessera.units"
            )
        self.partition = s["partition"]
        self.client = tessera.storage.Client(
            units=list(units),
            backend=s["backend"],
            recv_pool_bytes=int(s["recv_pool_bytes"]),
            token=s["token"],
            tensor_type="torch",
            timeout=float(s["timeout"]),
        )

    @staticmethod
    def _encode(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value
        return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)

    @staticmethod
    def _decode(value: Any) -> Any:
        if isinstance(value, bytes):
            return pickle.loads(value)
        return value

    def put(self, keys: list[str], values: list[Any]) -> None:
        if len(keys) != len(values):
            raise tessera.errors.UsageError(f"{len(keys)} keys and {len(values)} values")
        # One PUT per set of indexes: TransferQueue's keys are field-major over the same indexes.
        columns: dict[str, tuple[list[int], list[Any]]] = {}
        for (index, field), value in zip(_split(keys), values, strict=True):
            idx, vals = columns.setdefault(field, ([], []))
            idx.append(index)
            vals.append(self._encode(value))
        groups: dict[tuple[int, ...], dict[str, list[Any]]] = defaultdict(dict)
        for field, (idx, vals) in columns.items():
            groups[tuple(idx)][field] = vals
        for idx, fields in groups.items():
            self.client.put(self.partition, list(idx), fields)
        return None

    def get(self, keys: list[str], shapes=None, dtypes=None, custom_backend_meta=None) -> list[Any]:
        split = _split(keys)
        positions: dict[str, tuple[list[int], list[int]]] = {}
        for pos, (index, field) in enumerate(split):
            idx, where = positions.setdefault(field, ([], []))
            idx.append(index)
            where.append(pos)
        # One GET per set of indexes, for all the fields asked over it (usually all of them).
        groups: dict[tuple[int, ...], list[str]] = defaultdict(list)
        for field, (idx, _) in positions.items():
            groups[tuple(idx)].append(field)
        out: list[Any] = [None] * len(keys)
        for idx, fields in groups.items():
            got = self.client.get(self.partition, list(idx), fields)
            for field in fields:
                for pos, value in zip(positions[field][1], got[field], strict=True):
                    out[pos] = self._decode(value)
        return out

    def clear(self, keys: list[str], custom_backend_meta=None) -> None:
        fields: dict[str, list[int]] = defaultdict(list)
        for index, field in _split(keys):
            fields[field].append(index)
        for field, idx in fields.items():
            self.client.clear(self.partition, idx, fields=[field])

    def close(self) -> None:
        self.client.close()


@StorageManagerFactory.register(NAME)
class TesseraStorageManager(KVStorageManager):
    """TransferQueue's storage manager for ``backend.storage_backend: Tessera``."""

    def __init__(self, controller_info, config, zmq_context=None) -> None:
        config["client_name"] = CLIENT_NAME
        super().__init__(controller_info, config, zmq_context=zmq_context)

    def close(self) -> None:
        client = getattr(self, "storage_client", None)
        if client is not None:
            client.close()
        super().close()
        # `transfer_queue.close()` stops only the backends it knows: the process that started
        # units stops them when its client closes.
        stop_units()


# Units this process started: (Popen or Ray actor handle), stopped by `stop_units`.
_STARTED: list[Any] = []
# How long stopping waits for a killed unit actor to be gone.
_ACTOR_EXIT_S = 30.0
_LOCK = threading.Lock()


def _start_process(s: dict[str, Any]) -> tuple[subprocess.Popen, str]:
    return tessera.storage.serve_process(
        "--bind",
        "127.0.0.1:0",
        "--backend",
        s["backend"],
        "--pool",
        str(s["pool_bytes"]),
        "--capacity",
        str(s["capacity_bytes"]),
        token=s["token"],
    )


def _start_actor(s: dict[str, Any]) -> tuple[Any, str]:
    import ray

    actor = _UnitActor().options(num_cpus=0).remote(s)
    return actor, ray.get(actor.address.remote())


def _unit_actor_class():
    import ray

    @ray.remote(num_cpus=0)
    class TesseraUnit:
        """A Tessera unit served by a Ray actor (it takes no CPU from the cluster)."""

        def __init__(self, s: dict[str, Any]) -> None:
            self.server = tessera.storage.Server(
                bind="0.0.0.0:0" if s["backend"] == "tcp" else "127.0.0.1:0",
                backend=s["backend"],
                pool_bytes=s["pool_bytes"],
                capacity_bytes=s["capacity_bytes"],
                token=s["token"],
            )

        def address(self) -> str:
            return self.server.address

        def close(self) -> None:
            self.server.close()

    return TesseraUnit


_ACTOR_CLASS = None


def _UnitActor():
    global _ACTOR_CLASS
    if _ACTOR_CLASS is None:
        _ACTOR_CLASS = _unit_actor_class()
    return _ACTOR_CLASS


def start_units(s: dict[str, Any]) -> list[str]:
    """Starts ``num_units`` units as ``launch`` says and returns their addresses."""
    start = {"process": _start_process, "ray": _start_actor}.get(s["launch"])
    if start is None:
        raise tessera.errors.ConfigError(
            f"backend.Tessera.launch is {s['launch']!r}: expected 'process' or 'ray'"
        )
    addresses = []
    with _LOCK:
        try:
            for _ in range(int(s["num_units"])):
                handle, address = start(s)
                _STARTED.append(handle)
                addresses.append(address)
        except BaseException:
            _stop_locked()
            raise
    return addresses


def _stop_locked() -> None:
    while _STARTED:
        handle = _STARTED.pop()
        if isinstance(handle, subprocess.Popen):
            handle.terminate()
            try:
                handle.wait(30)
            except subprocess.TimeoutExpired:
                handle.kill()
                handle.wait()
        else:
            try:
                _kill_actor(handle)
            except Exception:  # Ray already shut down: the actor is gone with it
                pass


def _kill_actor(handle: Any) -> None:
    """Kills a unit's actor and returns once it is gone: ``ray.kill`` only asks for it, and a
    call made right after may still be answered (for at most ``_ACTOR_EXIT_S``)."""
    import ray

    ray.kill(handle)
    deadline = time.monotonic() + _ACTOR_EXIT_S
    while (left := deadline - time.monotonic()) > 0:
        try:
            ray.get(handle.address.remote(), timeout=left)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return
        time.sleep(0.02)


def stop_units() -> None:
    """Stops the units this process started (idempotent; also at exit)."""
    with _LOCK:
        _stop_locked()


atexit.register(stop_units)


@StorageBootstrapProvider.register_provider(NAME)
def bootstrap(conf: Any) -> list[str]:
    """TransferQueue's start-up hook: starts the units unless ``units`` lists running ones,
    and writes their addresses (and the registration marker) into ``backend.Tessera``."""
    section = conf.backend[NAME]
    s = settings(section)
    units = list(s["units"] or []) or start_units(s)
    section.units = units
    section.registered = Registered()
    return units


__all__ = [
    "CLIENT_NAME",
    "NAME",
    "Registered",
    "TesseraStorageClient",
    "TesseraStorageManager",
    "bootstrap",
    "settings",
    "start_units",
    "stop_units",
]
