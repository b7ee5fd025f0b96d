"""Tessera where the users are: a TransferQueue storage backend
(:mod:`tessera.integrations.transfer_queue`) and, later, a Ray RDT tensor transport."""
