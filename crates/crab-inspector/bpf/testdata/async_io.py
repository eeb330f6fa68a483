"""Writes files through io_uring and Linux AIO, the I/O the inspector cannot see.

Used by the inspector tests (tests/inspector.rs) and the turn-class corpus
(integration/tests/turn_classes.rs): only the standard library (ctypes, mmap).

    async_io.py uring PATH TEXT
        opens PATH and writes TEXT with io_uring requests (no open or write
        syscall), then exits.
    async_io.py aio PATH TEXT READY
        opens PATH for writing, creates READY and waits; on SIGUSR1 it writes
        TEXT with io_submit (no write syscall).
"""

import ctypes
import mmap
import os
import platform
import signal
import struct
import sys
import time

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long

NR = {
    "x86_64": {"io_setup": 206, "io_submit": 209, "io_getevents": 208},
    "aarch64": {"io_setup": 0, "io_submit": 2, "io_getevents": 4},
}[platform.machine()]
NR_IO_URING_SETUP = 425
NR_IO_URING_ENTER = 426

IORING_SETUP_SQPOLL = 1 << 1
IORING_ENTER_GETEVENTS = 1 << 0
IORING_ENTER_SQ_WAKEUP = 1 << 1
IORING_SQ_NEED_WAKEUP = 1 << 0
IORING_OFF_SQES = 0x10000000
IORING_OP_NOP = 0
IORING_OP_OPENAT = 18
IORING_OP_WRITE = 23
AT_FDCWD = -100
SQE = struct.Struct("<BBHiQQIIQHHiQQ")  # struct io_uring_sqe, 64 bytes
CQE = struct.Struct("<QiI")  # struct io_uring_cqe, 16 bytes
IOCB_CMD_PWRITE = 1
IOCB = struct.Struct("<QIIHhIQQqQII")  # struct iocb, 64 bytes
IO_EVENT = struct.Struct("<QQqq")


def syscall(nr, *args):
    ret = libc.syscall(nr, *[ctypes.c_long(a) if isinstance(a, int) else a for a in args])
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return ret


class Ring:
    """An io_uring instance with its rings mapped."""

    def __init__(self, flags=0, sq_thread_idle_ms=0):
        params = ctypes.create_string_buffer(120)
        struct.pack_into("<III", params, 8, flags, 0, sq_thread_idle_ms)
        self.fd = syscall(NR_IO_URING_SETUP, 8, params)
        self.polling = bool(flags & IORING_SETUP_SQPOLL)
        sq_entries, cq_entries = struct.unpack_from("<II", params, 0)
        self.sq = dict(zip(("head", "tail", "mask", "entries", "flags", "dropped", "array"),
                           struct.unpack_from("<7I", params, 40)))
        self.cq = dict(zip(("head", "tail", "mask", "entries", "overflow", "cqes"),
                           struct.unpack_from("<6I", params, 80)))
        size = max(self.sq["array"] + sq_entries * 4, self.cq["cqes"] + cq_entries * CQE.size)
        # The kernel lays both rings in one mapping (IORING_FEAT_SINGLE_MMAP, Linux 5.4+).
        self.rings = mmap.mmap(self.fd, size, offset=0)
        self.sqes = mmap.mmap(self.fd, sq_entries * SQE.size, offset=IORING_OFF_SQES)
        self.buffers = []

    def u32(self, off):
        return struct.unpack_from("<I", self.rings, off)[0]

    def submit(self, opcode, fd=0, addr=0, length=0, off=0, op_flags=0):
        """Queues one request and waits for its result, which it returns."""
        tail = self.u32(self.sq["tail"])
        index = tail & self.u32(self.sq["mask"])
        SQE.pack_into(self.sqes, index * SQE.size, opcode, 0, 0, fd, off, addr, length,
                      op_flags, tail, 0, 0, 0, 0, 0)
        struct.pack_into("<I", self.rings, self.sq["array"] + index * 4, index)
        struct.pack_into("<I", self.rings, self.sq["tail"], tail + 1)
        if not self.polling:
            syscall(NR_IO_URING_ENTER, self.fd, 1, 1, IORING_ENTER_GETEVENTS, 0, 0)
        elif self.u32(self.sq["flags"]) & IORING_SQ_NEED_WAKEUP:
            # The polling thread sleeps until the first request, and again
            # after sq_thread_idle without any: only then is a syscall needed.
            syscall(NR_IO_URING_ENTER, self.fd, 0, 0, IORING_ENTER_SQ_WAKEUP, 0, 0)
        while self.u32(self.cq["tail"]) == self.u32(self.cq["head"]):
            pass  # a polling ring completes without any syscall too
        head = self.u32(self.cq["head"])
        off = self.cq["cqes"] + (head & self.u32(self.cq["mask"])) * CQE.size
        _, res, _ = CQE.unpack_from(self.rings, off)
        struct.pack_into("<I", self.rings, self.cq["head"], head + 1)
        if res < 0:
            raise OSError(-res, os.strerror(-res))
        return res

    def buffer(self, data):
        buf = ctypes.create_string_buffer(data)
        self.buffers.append(buf)
        return ctypes.addressof(buf)

    def nop(self):
        self.submit(IORING_OP_NOP)

    def write_file(self, path, text):
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        fd = self.submit(IORING_OP_OPENAT, fd=AT_FDCWD, addr=self.buffer(path.encode()),
                         length=0o644, op_flags=flags)
        data = text.encode()
        self.submit(IORING_OP_WRITE, fd=fd, addr=self.buffer(data), length=len(data))


def aio_write(fd, text):
    ctx = ctypes.c_ulong(0)
    syscall(NR["io_setup"], 1, ctypes.byref(ctx))
    data = ctypes.create_string_buffer(text.encode())
    iocb = ctypes.create_string_buffer(IOCB.size)
    IOCB.pack_into(iocb, 0, 0, 0, 0, IOCB_CMD_PWRITE, 0, fd, ctypes.addressof(data),
                   len(text.encode()), 0, 0, 0, 0)
    iocbs = (ctypes.c_void_p * 1)(ctypes.addressof(iocb))
    syscall(NR["io_submit"], ctx.value, 1, iocbs)
    event = ctypes.create_string_buffer(IO_EVENT.size)
    syscall(NR["io_getevents"], ctx.value, 1, 1, event, 0)
    res = IO_EVENT.unpack_from(event, 0)[2]
    if res < 0:
        raise OSError(-res, os.strerror(-res))


def wait_for_signal(ready, on_signal):
    signal.signal(signal.SIGUSR1, lambda *_: on_signal())
    open(ready, "w").close()
    while True:
        time.sleep(3600)


def main():
    mode, path, text = sys.argv[1:4]
    if mode == "uring":
        Ring().write_file(path, text)
    elif mode == "aio":
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        wait_for_signal(sys.argv[4], lambda: aio_write(fd, text))
    else:
        sys.exit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main()
