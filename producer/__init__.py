"""The submit side: a Python client and the `kevlaya` CLI. Never imports torch."""

from producer.client import BatchHandle, Client

__all__ = ["BatchHandle", "Client"]
