"""Tensor pools of Ray RDT's shape.

A :class:`SenderPool` packs the tensors of one object into blocks of its registered memory and
returns one descriptor (``bytes``) for them; a :class:`ReceiverPool` reads the object into its
own registered blocks with one READ and returns views of them, each block going back to the
pool when the last view of it (or of a slice of it) is gone::

    sender = tessera.rdt.SenderPool(agent, capacity=1 << 30)
    desc = sender.put("weights-v1", [w0, w1, w2])
    views = tessera.rdt.ReceiverPool(other_agent, capacity=1 << 30).fetch(desc, peer)
    sender.free("weights-v1")
"""

from ._native import Cancel, ReceiverPool, SenderPool

__all__ = ["Cancel", "ReceiverPool", "SenderPool"]
