"""A Ray RDT tensor transport on Tessera: ``tensor_transport="TESSERA"``.

Importing this module registers the transport in this process (idempotently)::

    import tessera.integrations.ray  # noqa: F401  (registers "TESSERA")

    @ray.remote
    class Trainer:
        @ray.method(tensor_transport="TESSERA")
        def weights(self): return [w0, w1]

    ref = ray.put(tensor, _tensor_transport="TESSERA")  # one-sided: ray.put and ray.get work

Import it at the top of every module that defines actors using the transport (Ray checks the
name when the class body runs, in the actor's process too), and before creating them.

How it moves tensors: the sender's ``extract_tensor_transport_metadata`` puts the object's
tensors into the process's :class:`tessera.rdt.SenderPool` (packed into as few registered
blocks as fit, one descriptor for all of them) and hands Ray that descriptor, which carries the
sender agent's metadata; the receiver reads the object with one READ into its
:class:`tessera.rdt.ReceiverPool` and gets torch tensors that are views of its pool blocks, each
block returned when the last view of it is gone; with ``target_buffers``
(``ray.experimental.set_target_for_ref``) the READ lands in the caller's own tensors
instead. ``garbage_collect`` frees the sender's blocks.

Settings (environment variables, read when the transport first runs in a process):
``TESSERA_RAY_BACKEND`` (``shm``: one host; ``tcp`` across hosts), ``TESSERA_RAY_SEND_POOL_BYTES``
and ``TESSERA_RAY_RECV_POOL_BYTES`` (1 GiB each), ``TESSERA_TOKEN``.
"""

from __future__ import annotations

import os
import threading
import uuid
from dataclasses import dataclass
from typing import Any

import torch
from ray.experimental import register_tensor_transport
from ray.experimental.rdt import util as _rdt_util
from ray.experimental.rdt.tensor_transport_manager import (
    CommunicatorMetadata,
    TensorTransportManager,
    TensorTransportMetadata,
)

import tessera

NAME = "TESSERA"


@dataclass
class TesseraTransportMetadata(TensorTransportMetadata):
    """What a receiver needs: the object's descriptor (with the sender agent's metadata in it)
    and the sender agent's name and metadata, to add it as a peer the first time."""

    descriptor: bytes | None = None
    agent_name: str | None = None
    agent_metadata: bytes | None = None

    # Identity, as NIXL's metadata does: Ray keys objects by it.
    __eq__ = object.__eq__
    __hash__ = object.__hash__


@dataclass
class TesseraCommunicatorMetadata(CommunicatorMetadata):
    """Nothing: the transport is one-sided, the descriptor says everything."""


def _env_bytes(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


class TesseraTensorTransport(TensorTransportManager):
    """One per process (Ray makes it without arguments); the agent and pools are made on
    first use."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._agent: tessera.Agent | None = None
        self._sender: tessera.rdt.SenderPool | None = None
        self._receiver: tessera.rdt.ReceiverPool | None = None
        self._peers: dict[str, tessera.Peer] = {}
        self._objects: set[str] = set()
        # Fetches in flight (and aborts that came first), by object id.
        self._cancels: dict[str, tessera.rdt.Cancel] = {}

    def tensor_transport_backend(self) -> str:
        return NAME

    @staticmethod
    def is_one_sided() -> bool:
        return True

    @staticmethod
    def can_abort_transport() -> bool:
        # An aborted fetch fails at once; its blocks return when its READ has resolved.
        return True

    def actor_has_tensor_transport(self, actor: Any) -> bool:
        # Every process with tessera installed has it; agents are made on first use.
        return True

    def _ensure_agent(self) -> tessera.Agent:
        with self._lock:
            if self._agent is None:
                backend = os.environ.get("TESSERA_RAY_BACKEND", "shm")
                name = f"ray-rdt-{os.getpid()}-{uuid.uuid4().hex[:8]}"
                self._agent = tessera.Agent(
                    name, backend=backend, token=os.environ.get("TESSERA_TOKEN")
                )
            return self._agent

    def _sender_pool(self) -> tessera.rdt.SenderPool:
        with self._lock:
            if self._sender is None:
                self._sender = tessera.rdt.SenderPool(
                    self._ensure_agent(), _env_bytes("TESSERA_RAY_SEND_POOL_BYTES", 1 << 30)
                )
            return self._sender

    def _receiver_pool(self) -> tessera.rdt.ReceiverPool:
        with self._lock:
            if self._receiver is None:
                self._receiver = tessera.rdt.ReceiverPool(
                    self._ensure_agent(),
                    _env_bytes("TESSERA_RAY_RECV_POOL_BYTES", 1 << 30),
                    tensor_type="torch",
                )
            return self._receiver

    def extract_tensor_transport_metadata(
        self, obj_id: str, rdt_object: list[Any]
    ) -> TesseraTransportMetadata:
        tensors = list(rdt_object)
        if not tensors:
            return TesseraTransportMetadata(tensor_meta=[], tensor_device=None)
        devices = {t.device.type for t in tensors}
        if devices != {"cpu"}:
            raise ValueError(
                f"the TESSERA transport moves CPU tensors; these are on {sorted(devices)}"
            )
        sender = self._sender_pool()
        agent = self._ensure_agent()
        descriptor = sender.put(obj_id, tensors)
        with self._lock:
            self._objects.add(obj_id)
        return TesseraTransportMetadata(
            tensor_meta=[(t.shape, t.dtype) for t in tensors],
            tensor_device="cpu",
            descriptor=descriptor,
            agent_name=agent.name,
            agent_metadata=agent.metadata(),
        )

    def get_communicator_metadata(
        self, src_actor: Any, dst_actor: Any, backend: str | None = None
    ) -> TesseraCommunicatorMetadata:
        return TesseraCommunicatorMetadata()

    def _peer(self, meta: TesseraTransportMetadata) -> tessera.Peer:
        with self._lock:
            peer = self._peers.get(meta.agent_name)
            if peer is None:
                peer = self._ensure_agent().add_remote(meta.agent_metadata)
                self._peers[meta.agent_name] = peer
            return peer

    def recv_multiple_tensors(
        self,
        obj_id: str,
        tensor_transport_metadata: TesseraTransportMetadata,
        communicator_metadata: CommunicatorMetadata,
        target_buffers: list[Any] | None = None,
    ) -> list[Any]:
        meta = tensor_transport_metadata
        if not meta.tensor_meta:
            return []
        with self._lock:
            cancel = self._cancels.setdefault(obj_id, tessera.rdt.Cancel())
        try:
            # With target buffers the READ lands in them (registered for it, no copy);
            # otherwise in the receive pool, whose views are returned.
            return self._receiver_pool().fetch(
                meta.descriptor,
                self._peer(meta),
                cancel=cancel,
                into=list(target_buffers) if target_buffers else None,
            )
        finally:
            with self._lock:
                self._cancels.pop(obj_id, None)

    def send_multiple_tensors(
        self,
        tensors: list[Any],
        tensor_transport_metadata: TensorTransportMetadata,
        communicator_metadata: CommunicatorMetadata,
    ) -> None:
        raise NotImplementedError("TESSERA is one-sided: receivers read, senders never send")

    def garbage_collect(
        self, obj_id: str, tensor_transport_meta: TensorTransportMetadata, tensors: list[Any]
    ) -> None:
        with self._lock:
            if obj_id not in self._objects:
                return
            self._objects.discard(obj_id)
            sender = self._sender
        if sender is not None:
            sender.free(obj_id)

    def abort_transport(self, obj_id: str, communicator_metadata: CommunicatorMetadata) -> None:
        # Receiver: the fetch in flight (or the one about to start) fails. Sender: nothing to do,
        # garbage_collect frees the object when Ray lets it go.
        with self._lock:
            cancel = self._cancels.setdefault(obj_id, tessera.rdt.Cancel())
        cancel.cancel()


def register() -> None:
    """Registers ``TESSERA`` with Ray in this process, once."""
    if NAME not in _rdt_util.transport_manager_info:
        register_tensor_transport(NAME, ["cpu"], TesseraTensorTransport, torch.Tensor)


register()

__all__ = [
    "NAME",
    "TesseraCommunicatorMetadata",
    "TesseraTensorTransport",
    "TesseraTransportMetadata",
    "register",
]
