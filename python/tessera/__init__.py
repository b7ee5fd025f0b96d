"""Tessera: tensors between processes and machines through registered memory, without copies.

- :mod:`tessera.storage`: PUT / GET / CLEAR storage units and their clients (blocking and
  asyncio), TransferQueue's shape.
- :class:`Agent`, :mod:`tessera.rdt`: agents and the sender and receiver tensor pools of Ray
  RDT's shape.

Errors are :class:`tessera.TesseraError` and its subclasses (:mod:`tessera.errors`).
"""

from . import errors, rdt, storage
from ._native import Agent, Peer, Tensor, __version__, backends, copies, dtypes
from .errors import (
    CapacityError,
    MissingKeys,
    StorageError,
    TesseraError,
    TesseraTimeout,
    TransferError,
)

__all__ = [
    "Agent",
    "CapacityError",
    "MissingKeys",
    "Peer",
    "StorageError",
    "Tensor",
    "TesseraError",
    "TesseraTimeout",
    "TransferError",
    "__version__",
    "backends",
    "copies",
    "dtypes",
    "errors",
    "rdt",
    "storage",
]
