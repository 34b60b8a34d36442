"""This machine's network interfaces and their IPv4 addresses (Linux ioctl, no dependency).

Used by the launcher (which of our addresses every host reaches) and by ``init()`` under
mpirun (where rank 0 serves the rendezvous).

Layer: rendezvous.  Imports nothing from hora.
"""
import fcntl
import socket
import struct

__all__ = ["interface_address", "local_addresses", "routable_addresses"]

_SIOCGIFADDR = 0x8915


def interface_address(name):
    """The IPv4 address of network interface ``name``, or None (no such interface)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR,
                                 struct.pack("256s", name[:15].encode()))
        return socket.inet_ntoa(packed[20:24])
    except (OSError, ValueError):
        return None


def local_addresses():
    """``[(interface, IPv4 address)]`` of this machine, loopback and link-local last."""
    found = []
    for _, name in socket.if_nameindex():
        addr = interface_address(name)
        if addr is not None:
            found.append((name, addr))
    return sorted(found, key=lambda na: (na[1].startswith("127."), na[1].startswith("169.254.")))


def routable_addresses(prefer_interface=None):
    """This machine's non-loopback IPv4 addresses; ``prefer_interface``'s first if it has one."""
    addrs = [a for _, a in local_addresses() if not a.startswith("127.")]
    preferred = interface_address(prefer_interface) if prefer_interface else None
    if preferred is not None:
        addrs = [preferred] + [a for a in addrs if a != preferred]
    return addrs
