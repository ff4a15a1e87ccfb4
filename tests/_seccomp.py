"""Make the kernel refuse one system call in this process and its children, as an
old kernel (``ENOSYS``) or a container's seccomp profile (``EPERM``) does.

A real seccomp filter (``prctl(PR_SET_SECCOMP)``), not a patched function: fsstore
sees exactly what it would see on such a machine. Used through
``FSSTORE_TEST_DENY_OPENAT2`` (tests/conftest.py) to run tests without ``openat2``.
"""

from __future__ import annotations

import ctypes
import errno
import platform

# AUDIT_ARCH_* of the architectures fsstore knows openat2's number on
_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7, "arm64": 0xC00000B7}
SYS_OPENAT2 = 437  # the same on x86_64 and aarch64

_PR_SET_NO_NEW_PRIVS, _PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 38, 22, 2
_LD_W_ABS, _JEQ_K, _RET_K = 0x20, 0x15, 0x06
_RET_ALLOW, _RET_ERRNO = 0x7FFF0000, 0x00050000


class _Insn(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8),
                ("k", ctypes.c_uint32)]


class _Prog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_Insn))]


def deny(nr: int, err: int) -> None:
    """From now on system call ``nr`` fails with ``err`` in this process and its children."""
    arch = _ARCH[platform.machine()]
    insns = (_Insn * 6)(
        _Insn(_LD_W_ABS, 0, 0, 4),   # seccomp_data.arch
        _Insn(_JEQ_K, 0, 3, arch),    # another ABI: allow
        _Insn(_LD_W_ABS, 0, 0, 0),   # seccomp_data.nr
        _Insn(_JEQ_K, 0, 1, nr),
        _Insn(_RET_K, 0, 0, _RET_ERRNO | err),
        _Insn(_RET_K, 0, 0, _RET_ALLOW),
    )
    prog = _Prog(len(insns), insns)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 or \
            libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"seccomp filter not installed: {errno.errorcode.get(e, e)}")
