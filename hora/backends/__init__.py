"""How bytes move between ranks.  Knows nothing of tensor names or requests.

The contracts (:mod:`hora.backends.base`): a Transport moves bytes, a Plane runs the
collectives, a WaitPolicy carries the owner's choices about waiting.
"""
from .base import NetworkTransport, Plane, Transport, WaitPolicy
from .tcp import TcpTransport

__all__ = ["NetworkTransport", "Plane", "TcpTransport", "Transport", "WaitPolicy"]
