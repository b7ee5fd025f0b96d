"""The exceptions tessera raises: one hierarchy under :class:`TesseraError`.

Each exception carries the fields of the Rust error it stands for as attributes (``unit``,
``kind``, ``missing``, ...); attributes an error does not have are ``None``.
"""

from __future__ import annotations

from typing import Any


class TesseraError(Exception):
    """Any error of tessera. ``str(e)`` is the whole message; fields are attributes."""

    unit: int | None = None
    kind: str | None = None

    def __init__(self, message: str, **fields: Any) -> None:
        super().__init__(message)
        self.message = message
        self.fields = fields
        for name, value in fields.items():
            setattr(self, name, value)

    def __reduce__(self):  # pickles with its fields (errors cross process boundaries)
        return (_rebuild, (type(self), self.message, self.fields))


def _rebuild(cls: type[TesseraError], message: str, fields: dict[str, Any]) -> TesseraError:
    return cls(message, **fields)


class UsageError(TesseraError, ValueError):
    """The caller passed something this API does not take."""


class ValueTypeError(TesseraError, TypeError):
    """A value of a type tessera cannot store."""


class ConfigError(TesseraError, ValueError):
    """A configuration that cannot work (unknown backend, backend mismatch, bad address)."""


class DeviceError(TesseraError, ValueError):
    """A tensor on a device this build cannot move (a CUDA tensor): ``device`` says which."""


class ClosedError(TesseraError):
    """An object used after ``close()``."""


class ForkedError(TesseraError):
    """An object, or the runtime, inherited through ``fork()``: create a new one in the child."""


class EngineError(TesseraError):
    """An engine (agent) that did not start."""


class EngineNotBuilt(EngineError):
    """An engine this build lacks; ``feature`` names the cargo feature that builds it in."""


class StorageError(TesseraError):
    """A unit answered with an error; ``kind`` is its kind (``"busy"``, ``"too_large"``, ...).
    With replicas: ``"replicas"`` (a PUT some units holding copies did not store; ``units``
    names them) and ``"lost"`` (``indexes`` whose every replica failed; ``units``)."""


class MissingKeys(StorageError):
    """Keys asked for are not stored; ``missing`` lists them as ``(field, index)``."""

    missing: list[tuple[str, int]]


class CapacityError(StorageError):
    """Out of room: a unit's capacity or memory, or a pool of this process (``kind`` says)."""


class AuthError(StorageError, PermissionError):
    """The token is missing or wrong (``had_token`` says whether this client had one)."""


class ConnectError(TesseraError, ConnectionError):
    """A unit's address could not be reached, or its connection failed."""


class ServerError(TesseraError):
    """A unit that did not start."""


class TransferError(TesseraError):
    """A payload transfer failed; its outcome is unknown and it was not retried."""


class TesseraTimeout(TesseraError, TimeoutError):
    """No answer in time; the outcome is unknown and the request was not retried."""


class ProtocolError(TesseraError):
    """A peer sent something the protocol does not allow."""


class CodecError(TesseraError, ValueError):
    """Values that cannot be encoded (limits, shapes)."""


class RegistrationError(TesseraError):
    """Memory that could not be registered or described."""


class PoolError(TesseraError):
    """A tensor pool's operation failed."""


class UnknownObject(PoolError, KeyError):
    """No object has this id in the sender pool."""

    def __str__(self) -> str:  # KeyError would quote the message
        return self.message


class DescriptorError(PoolError, ValueError):
    """An object descriptor that is malformed or breaks a limit."""


__all__ = [
    "AuthError",
    "CapacityError",
    "ClosedError",
    "CodecError",
    "ConfigError",
    "ConnectError",
    "DescriptorError",
    "DeviceError",
    "EngineError",
    "EngineNotBuilt",
    "ForkedError",
    "MissingKeys",
    "PoolError",
    "ProtocolError",
    "RegistrationError",
    "ServerError",
    "StorageError",
    "TesseraError",
    "TesseraTimeout",
    "TransferError",
    "UnknownObject",
    "UsageError",
    "ValueTypeError",
]
