"""The TransferQueue key-value client on Tessera units, without a TransferQueue cluster (the
e2e tests of TransferQueue itself run in `cargo xtask test` with the pytest plugin)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transfer_queue")

import tessera  # noqa: E402
from tessera.integrations import transfer_queue as ttq  # noqa: E402


@pytest.fixture
def kv(unit):
    c = ttq.TesseraStorageClient({"units": [unit.address], "recv_pool_bytes": 64 << 20})
    yield c
    c.close()


def test_keys_values_and_non_tensors_round_trip(kv):
    keys = ["3@a", "4@a", "3@b", "4@b", "3@c", "4@c"]
    values = [
        torch.arange(5),
        torch.arange(7),
        {"x": (1, 2)},
        np.bytes_(b"raw"),
        torch.tensor(1.5, dtype=torch.bfloat16),
        None,
    ]
    assert kv.put(keys, values) is None
    got = kv.get(list(reversed(keys)), None, None, None)
    want = list(reversed(values))
    for g, w in zip(got, want, strict=True):
        if isinstance(w, torch.Tensor):
            assert torch.equal(g, w) and g.dtype == w.dtype
        else:
            assert g == w and type(g) is type(w)


def test_put_overwrites_and_clear_tolerates_missing_keys(kv):
    kv.put(["1@f"], [torch.ones(3)])
    kv.put(["1@f"], [torch.zeros(3)])
    assert torch.equal(kv.get(["1@f"])[0], torch.zeros(3))
    kv.clear(["1@f", "99@nope"])
    kv.clear(["1@f"])
    with pytest.raises(tessera.MissingKeys):
        kv.get(["1@f"])


def test_results_are_independent_of_the_store(kv):
    kv.put(["0@t"], [torch.arange(4.0)])
    first = kv.get(["0@t"])[0]
    first += 100
    assert torch.equal(kv.get(["0@t"])[0], torch.arange(4.0))


def test_bad_keys_and_config():
    with pytest.raises(tessera.errors.ConfigError, match="no units"):
        ttq.TesseraStorageClient({})
    with pytest.raises(tessera.errors.UsageError, match="index@field"):
        ttq._split(["nope"])
