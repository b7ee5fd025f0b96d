import os

import pytest

import tessera

# `cargo xtask test` installs torch: there, a torch that does not import fails the run instead
# of skipping its tests.
if os.environ.get("TESSERA_REQUIRE_TORCH"):
    import torch  # noqa: F401


@pytest.fixture
def unit():
    with tessera.storage.Server(bind="127.0.0.1:0", backend="shm", pool_bytes=256 << 20) as u:
        yield u


@pytest.fixture
def client(unit):
    with tessera.storage.Client(
        units=[unit.address], backend="shm", recv_pool_bytes=256 << 20, tensor_type="numpy"
    ) as c:
        yield c


@pytest.fixture
def torch_client(unit):
    pytest.importorskip("torch")
    with tessera.storage.Client(
        units=[unit.address], backend="shm", recv_pool_bytes=256 << 20, tensor_type="torch"
    ) as c:
        yield c
