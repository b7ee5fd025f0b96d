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

    def sender_report(self):
        from ray.experimental.rdt.util import get_tensor_transport_manager

        pool = get_tensor_transport_manager("TESSERA")._sender
        return None if pool is None else pool.report()


@ray.remote(num_cpus=0)
class Consumer:
    def sums(self, tensors):
        return [float(t.float().sum()) for t in tensors]

    def receiver_report(self):
        from ray.experimental.rdt.util import get_tensor_transport_manager

        pool = get_tensor_transport_manager("TESSERA")._receiver
        return None if pool is None else pool.report()
