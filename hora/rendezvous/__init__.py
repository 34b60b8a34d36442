"""Authenticated key-value rendezvous: the server the launcher runs, the client workers use."""
from .client import RendezvousClient, connect_with_retry
from .protocol import new_secret
from .server import RendezvousServer

__all__ = ["RendezvousClient", "RendezvousServer", "connect_with_retry", "new_secret"]
