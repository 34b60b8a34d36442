"""How bytes move between ranks.  Knows nothing of tensor names or requests."""
from .tcp import TcpTransport

__all__ = ["TcpTransport"]
