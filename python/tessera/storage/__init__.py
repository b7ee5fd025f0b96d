"""Storage units and their clients: PUT / GET / CLEAR of ``(partition, index, field)`` keys.

::

    with tessera.storage.Server(bind="127.0.0.1:0", backend="shm") as unit:
        with tessera.storage.Client(units=[unit.address], backend="shm",
                                    tensor_type="torch") as client:
            client.put("step-0", [0, 1], {"tokens": [t0, t1], "reward": [0.5, 1.0]})
            got = client.get("step-0", [0, 1], ["tokens"])  # {"tokens": [tensor, tensor]}
            client.clear("step-0", [0, 1])

PUT sends tensors from their own memory (a non-contiguous one is copied once, counted in
``tessera.copies()``). GET results are views of the client's receive pool (small results: of
the answer's message) and writable: the memory is this client's alone. A result, or any view,
slice or ``.numpy()`` of it, keeps its block; the block returns to the pool when the last one
is garbage-collected.

Calls release the GIL while they wait; Ctrl-C raises ``KeyboardInterrupt`` at once, and the
interrupted request finishes in the background (within the client's timeout) and frees what it
held. A client belongs to the process that made it: a forked child gets ``ForkedError``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from tessera import _native

__all__ = ["AsyncClient", "Client", "Server", "serve_process"]

# `ServerConfig.unit` (the protocol core's settings), given flat to `Server(...)`.
_UNIT_KEYS = frozenset(
    {
        "capacity_bytes",
        "inline_max",
        "align",
        "max_keys",
        "max_payload_bytes",
        "max_meta_bytes",
        "leased_limit",
        "session_leased_limit",
        "quarantine_limit",
        "session_quarantine_limit",
        "key_overhead_bytes",
        "max_stored_keys",
        "slice_keys",
        "prepare_ttl",
        "late_write_grace",
        "compact_dead_fraction",
        "token",
    }
)
# Durations: seconds as numbers here, strings with a unit ("30s", "500ms") as in the TOML file.
_DURATION_KEYS = frozenset(
    {
        "handshake_timeout",
        "frame_timeout",
        "peer_add_timeout",
        "transfer_timeout",
        "prepare_ttl",
        "late_write_grace",
    }
)


def _setting(key: str, value: Any) -> Any:
    if key in _DURATION_KEYS and isinstance(value, int | float) and not isinstance(value, bool):
        return f"{value * 1000:.6g}ms"
    if key == "token" and isinstance(value, bytes):
        return value.decode()
    return value


def server_config(**options: Any) -> str:
    """The unit configuration ``Server(**options)`` starts with, as JSON (``ServerConfig``)."""
    config: dict[str, Any] = {}
    unit: dict[str, Any] = dict(options.pop("unit", None) or {})
    for key, value in options.items():
        if value is None:
            continue
        if key in _UNIT_KEYS:
            unit[key] = _setting(key, value)
        else:
            config[key] = _setting(key, value)
    if unit:
        config["unit"] = unit
    return json.dumps(config)


class Server:
    """A storage unit served by this process until :meth:`close` (or the ``with`` block ends).

    ``bind`` is the control address (port 0 picks one; :attr:`address` says which). Any other
    setting of the unit's TOML configuration is a keyword: sizes in bytes or strings with a
    unit (``"1GiB"``), durations in seconds or strings with a unit (``"500ms"``), and the
    unit's own settings (``capacity_bytes``, ``token``, ...) flat beside the server's.
    """

    def __init__(
        self,
        bind: str = "127.0.0.1:0",
        backend: str = "shm",
        pool_bytes: int | str | None = None,
        **options: Any,
    ) -> None:
        self._native = _native.Server(
            server_config(bind=bind, backend=backend, pool_bytes=pool_bytes, **options)
        )

    @property
    def address(self) -> str:
        """The control address clients connect to."""
        return self._native.address

    @property
    def backend(self) -> str:
        return self._native.backend

    @property
    def closed(self) -> bool:
        return self._native.closed

    def stats(self) -> dict[str, Any]:
        """The unit's statistics (the STATS figures)."""
        return self._native.stats()

    def registered_bytes(self) -> int:
        return self._native.registered_bytes()

    def close(self) -> None:
        """Stops the unit; its sessions end and what they held is released. Idempotent."""
        self._native.close()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else self.address
        return f"tessera.storage.Server({state}, backend={self.backend!r})"


def serve_process(
    *flags: str,
    token: str | bytes | None = None,
    preexec_fn: Callable[[], None] | None = None,
) -> tuple[subprocess.Popen, str]:
    """Starts ``python -m tessera.storage serve FLAGS...`` as a child process and returns it
    with the address it listens on (once it does). ``token`` goes to it through
    ``TESSERA_TOKEN``, never its command line. Stop it with ``terminate()``."""
    cmd = [sys.executable, "-m", "tessera.storage", "serve", "--quiet", "--announce", *flags]
    env = None
    if token:
        env = dict(os.environ, TESSERA_TOKEN=token.decode() if isinstance(token, bytes) else token)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env, preexec_fn=preexec_fn)
    line = proc.stdout.readline() if proc.stdout else ""
    if not line.startswith("listening "):
        proc.kill()
        proc.wait()
        from tessera.errors import ServerError

        raise ServerError(f"the unit did not start: {line.strip()!r}")
    return proc, line.split()[1]


def _client_args(
    units: Sequence[str],
    backend: str,
    recv_pool_bytes: int,
    token: str | bytes | None,
    tensor_type: str,
    timeout: float,
    payload_addr: str | None,
    max_message_bytes: int,
    replicas: int,
    placement: str,
    prefault_recv_pool: bool,
    busy_poll: bool,
) -> tuple:
    if isinstance(units, str):
        units = [units]
    return (
        list(units),
        backend,
        recv_pool_bytes,
        token,
        tensor_type,
        float(timeout),
        payload_addr,
        max_message_bytes,
        int(replicas),
        placement,
        bool(prefault_recv_pool),
        bool(busy_poll),
    )


class Client:
    """A client of one or more units; index ``i`` lives on unit ``i % len(units)``.

    ``replicas`` (1 to the number of units) keeps that many copies of every value: a PUT
    succeeds only when every unit holding a copy stored it (else ``StorageError`` with
    ``kind == "replicas"``), a GET falls over to the next copy when a unit fails, and indexes
    whose every copy failed raise ``StorageError`` with ``kind == "lost"``. ``placement``:
    ``"modulo"`` (the copies of ``i`` on the units after ``i % len(units)``) or
    ``"rendezvous"`` (highest-random-weight hashing over the units' addresses: a unit added
    to or removed from the list moves only its share of the keys).

    ``prefault_recv_pool`` faults every page of the receive pool (``recv_pool_bytes``) in when
    the client connects, as an RDMA registration would pin them, so that no GET lands in fresh
    memory and pays for its first touch; the whole pool is then resident.

    ``busy_poll`` (on by default) keeps one of tessera's threads polling the control sockets
    for up to 50 us (up to 500 us past the request for an answer that requests of its shape
    took that long lately) while a request waits for its answer, instead of sleeping until the
    kernel wakes it: a small request's round trip to a unit on another core then skips that
    core's wake-up (tens of microseconds on virtual machines; a 4-byte PUT took about 18 us
    against 33 us on a 2-vCPU machine, pinned or not). It costs CPU time only while a request
    waits; ``busy_poll=False`` sleeps instead.

    ``tensor_type`` says what GET returns for tensors: ``"numpy"`` arrays, ``"torch"``
    tensors, or ``"tessera"`` (:class:`tessera.Tensor`, viewable by both without a copy).
    """

    def __init__(
        self,
        units: Sequence[str],
        backend: str = "shm",
        recv_pool_bytes: int = 1 << 30,
        token: str | bytes | None = None,
        tensor_type: str = "numpy",
        timeout: float = 60.0,
        payload_addr: str | None = None,
        max_message_bytes: int = 256 << 20,
        replicas: int = 1,
        placement: str = "modulo",
        prefault_recv_pool: bool = False,
        busy_poll: bool = True,
    ) -> None:
        self._native = _native.Client(
            *_client_args(
                units,
                backend,
                recv_pool_bytes,
                token,
                tensor_type,
                timeout,
                payload_addr,
                max_message_bytes,
                replicas,
                placement,
                prefault_recv_pool,
                busy_poll,
            )
        )

    @classmethod
    def _wrap(cls, native: Any) -> Client:
        self = cls.__new__(cls)
        self._native = native
        return self

    @property
    def units(self) -> list[str]:
        return self._native.units

    @property
    def backend(self) -> str:
        return self._native.backend

    @property
    def tensor_type(self) -> str:
        return self._native.tensor_type

    @property
    def closed(self) -> bool:
        return self._native.closed

    def put(self, partition: str, indexes: Iterable[int], fields: Mapping[str, Any]) -> None:
        """Stores ``fields`` (``{field: column}``) at ``indexes``. A column is a list with one
        value per index, or a tensor whose first dimension runs over the indexes (split into
        row views without a copy)."""
        self._native.put(partition, indexes, dict(fields))

    def get(
        self, partition: str, indexes: Iterable[int], fields: Sequence[str]
    ) -> dict[str, list[Any]]:
        """Reads ``fields`` at ``indexes``: ``{field: [value per index]}``."""
        return self._native.get(partition, indexes, list(fields))

    def clear(
        self,
        partition: str,
        indexes: Iterable[int] | None = None,
        *,
        fields: Sequence[str] | None = None,
        all: bool = False,
    ) -> None:
        """Removes ``indexes`` (only ``fields`` when given), or the partition with
        ``all=True``. Idempotent."""
        self._native.clear(
            partition, indexes, fields=None if fields is None else list(fields), all=all
        )

    def stats(self) -> list[dict[str, Any]]:
        """Every unit's statistics, in unit order."""
        return self._native.stats()

    def report(self) -> dict[str, int]:
        """The receive pool (``capacity``, ``used``, ``leased``, ``quarantined``, ``free``,
        ``largest_free``, ``live_blocks``, ``address``) and this process's ``copies`` and
        ``copied_bytes``."""
        return self._native.report()

    def close(self) -> None:
        """Closes the sessions; results already returned stay valid. Idempotent."""
        self._native.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else ", ".join(self.units)
        return f"tessera.storage.Client({state}, backend={self.backend!r})"


class AsyncClient:
    """:class:`Client`'s methods as coroutines; requests run concurrently and pipelined.

    Make one with ``await AsyncClient.connect(units=[...], ...)`` (the same arguments as
    :class:`Client`). Cancelling a request's coroutine does not cancel the request: it runs to
    its end and frees what it held.
    """

    def __init__(self, native: Any) -> None:
        self._native = native

    @classmethod
    async def connect(
        cls,
        units: Sequence[str],
        backend: str = "shm",
        recv_pool_bytes: int = 1 << 30,
        token: str | bytes | None = None,
        tensor_type: str = "numpy",
        timeout: float = 60.0,
        payload_addr: str | None = None,
        max_message_bytes: int = 256 << 20,
        replicas: int = 1,
        placement: str = "modulo",
        prefault_recv_pool: bool = False,
        busy_poll: bool = True,
    ) -> AsyncClient:
        native = await _native.Client.connect_async(
            *_client_args(
                units,
                backend,
                recv_pool_bytes,
                token,
                tensor_type,
                timeout,
                payload_addr,
                max_message_bytes,
                replicas,
                placement,
                prefault_recv_pool,
                busy_poll,
            )
        )
        return cls(native)

    @property
    def units(self) -> list[str]:
        return self._native.units

    @property
    def closed(self) -> bool:
        return self._native.closed

    async def put(self, partition: str, indexes: Iterable[int], fields: Mapping[str, Any]) -> None:
        await self._native.put_async(partition, indexes, dict(fields))

    async def get(
        self, partition: str, indexes: Iterable[int], fields: Sequence[str]
    ) -> dict[str, list[Any]]:
        return await self._native.get_async(partition, indexes, list(fields))

    async def clear(
        self,
        partition: str,
        indexes: Iterable[int] | None = None,
        *,
        fields: Sequence[str] | None = None,
        all: bool = False,
    ) -> None:
        await self._native.clear_async(
            partition, indexes, fields=None if fields is None else list(fields), all=all
        )

    async def stats(self) -> list[dict[str, Any]]:
        return await self._native.stats_async()

    def report(self) -> dict[str, int]:
        return self._native.report()

    def blocking(self) -> Client:
        """The same client (sessions, pool) with the blocking methods."""
        return Client._wrap(self._native)

    def close(self) -> None:
        self._native.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()
