"""Actors of the Ray RDT tests (importable by Ray's workers: the tests put this folder on their
PYTHONPATH)."""

import ray
import torch

import tessera.integrations.ray  # noqa: F401  (registers TESSERA here and in the actors)


@ray.remote(num_cpus=0)
class Producer:
    @ray.method(tensor_transport="TESSERA")
    def make(self, n: int, k: int):
        return [torch.full((n,), float(i)) for i in range(k)]

    @ray.method(tensor_transport="TESSERA")
    def empty(self):
        return [torch.zeros(0), torch.ones(3, dtype=torch.bfloat16)]

    @ray.method(tensor_transport="TESSERA")
    def views(self, n: int):
        base = torch.arange(n * 8, dtype=torch.float32)
        return list(base.split(8))

    @ray.method(tensor_transport="TESSERA")
    def mixed(self):
        return [
            torch.ones(4, 4, dtype=torch.bfloat16),
            torch.arange(10, dtype=torch.int64),
            torch.tensor([True, False]),
            torch.randn(3, dtype=torch.complex64),
            torch.ones(2, dtype=torch.float8_e4m3fn),
        ]

    def pid(self):
        import os

        return os.getpid()

    def sender_report(self):
        from ray.experimental.rdt.util import get_tensor_transport_manager

        pool = get_tensor_transport_manager("TESSERA")._sender
        return None if pool is None else pool.report()


# Receivers need the tensor transport too (see the bench's Sink): their receives run on
# the actor's system thread.
@ray.remote(num_cpus=0, enable_tensor_transport=True)
class Consumer:
    def sums(self, tensors):
        return [float(t.float().sum()) for t in tensors]

    def describe(self, tensors):
        return [(str(t.dtype), tuple(t.shape)) for t in tensors]

    def count_and_check(self, tensors):
        ok = all(float(t[0]) == 8.0 * i for i, t in enumerate(tensors))
        return len(tensors), ok

    def receiver_report(self):
        from ray.experimental.rdt.util import get_tensor_transport_manager

        pool = get_tensor_transport_manager("TESSERA")._receiver
        return None if pool is None else pool.report()
