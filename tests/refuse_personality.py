"""Run a command under a seccomp filter that refuses ``personality()`` as Docker's default
profile does: the query (0xffffffff) passes, any other value fails with EPERM.

    python tests/refuse_personality.py COMMAND [ARG...]

For the tests of ``HORA_RANK_ASLR`` where a container's profile refuses the fixed layout.
x86-64 Linux only (the filter checks the architecture and lets every other call through).
"""
import ctypes
import os
import sys

_PR_SET_NO_NEW_PRIVS, _PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 38, 22, 2
_LD_W_ABS, _JEQ_K, _RET_K = 0x20, 0x15, 0x06          # classic BPF opcodes
_ARCH_X86_64, _NR_PERSONALITY = 0xC000003E, 135
_ALLOW, _EPERM = 0x7FFF0000, 0x00050000 | 1           # SECCOMP_RET_ALLOW, RET_ERRNO(EPERM)
# seccomp_data: nr at 0, arch at 4, args[0] at 16 (its low half, little-endian)
_PROGRAM = [
    (_LD_W_ABS, 0, 0, 4),
    (_JEQ_K, 0, 5, _ARCH_X86_64),       # another architecture: allow
    (_LD_W_ABS, 0, 0, 0),
    (_JEQ_K, 0, 3, _NR_PERSONALITY),    # another call: allow
    (_LD_W_ABS, 0, 0, 16),
    (_JEQ_K, 1, 0, 0xFFFFFFFF),         # the query: allow
    (_RET_K, 0, 0, _EPERM),
    (_RET_K, 0, 0, _ALLOW),
]


class _Filter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte),
                ("k", ctypes.c_uint)]


class _Program(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_Filter))]


def refuse_personality():
    """Install the filter on this process (and so on every process it starts)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong,
                           ctypes.c_ulong]
    filters = (_Filter * len(_PROGRAM))(*[_Filter(*f) for f in _PROGRAM])
    program = _Program(len(_PROGRAM), filters)
    if (libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, None, 0, 0) != 0
            or libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.addressof(program),
                          0, 0) != 0):
        raise OSError(ctypes.get_errno(), "could not install the seccomp filter")


if __name__ == "__main__":
    refuse_personality()
    os.execvp(sys.argv[1], sys.argv[1:])
