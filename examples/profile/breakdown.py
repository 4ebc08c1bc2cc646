#!/usr/bin/env python3
"""Splits `perf script -F pid,ip,sym` call stacks into the parts of a mirrored write.

Usage: breakdown.py STACKS CPU_US_PER_IO PID=NAME...  (see mirror-write.sh)
Every sample counts once, in the first category that matches its stack; the shares
are scaled so that all samples together make CPU_US_PER_IO.
"""
import collections
import sys

KERNEL = [  # (frame that marks it, category), first match wins
    ("__x64_sys_pwrite64", "kernel: pwrite into the page cache"),
    ("unix_stream_recvmsg", "kernel: NBD receive (Unix socket)"),
    ("unix_stream_sendmsg", "kernel: NBD replies (Unix socket)"),
    ("tcp_recvmsg", "kernel: peer link receive (TCP)"),
    ("tcp_sendmsg", "kernel: peer link send (TCP, with loopback delivery)"),
    ("epoll_wait", "kernel: epoll, sleep and wake-up"),
    ("schedule", "kernel: epoll, sleep and wake-up"),
    ("futex", "kernel: epoll, sleep and wake-up"),
]
ALLOC = ("malloc", "free", "_int_", "unlink_chunk", "__rdl_", "__rust_alloc",
         "__rust_dealloc", "realloc", "tcache")
USER = [  # (substring of the first matching frame from the leaf up, category)
    ("wire::header::checksum", "user: frame crc32"),
    ("wire::", "user: wire codec"),
    ("protocol::endpoint", "user: protocol (endpoint, activity log)"),
    ("export::nbd", "user: NBD parse and reply"),
    ("transport::", "user: transport (framing, queues)"),
    ("mirror::", "user: mirror driver (submit, turn, completions)"),
    ("vsan_core::device", "user: device"),
]


def stacks(path):
    pid, frames = None, []
    for line in open(path, errors="replace"):
        if not line.strip():
            continue
        if not line.startswith("\t"):
            if pid is not None:
                yield pid, frames
            pid, frames = line.split()[0], []
        else:
            parts = line.strip().split(None, 1)
            frames.append((parts[0], parts[1] if len(parts) > 1 else "?"))
    if pid is not None:
        yield pid, frames


def category(frames):
    syms = [s for _, s in frames]
    if frames[0][0].startswith("ffffffff"):
        for mark, cat in KERNEL:
            if any(mark in s for s in syms):
                return cat
        return "kernel: other"
    if "crc32" in syms[0]:
        return "user: frame crc32"
    if any(a in syms[0] for a in ALLOC):
        return "user: allocator"
    if "memmove" in syms[0] or "memcpy" in syms[0]:
        return "user: memcpy"
    for s in syms:
        for mark, cat in USER:
            if mark in s:
                return cat
    return "user: runtime and other"


def main():
    path, cpu = sys.argv[1], float(sys.argv[2])
    names = dict(a.split("=", 1) for a in sys.argv[3:])
    counts = collections.Counter()
    for pid, frames in stacks(path):
        if frames and pid in names:
            counts[(names[pid], category(frames))] += 1
    total = sum(counts.values())
    if not total:
        sys.exit("no samples")
    per = cpu / total
    print(f"CPU per write, all processes sampled: {cpu} us ({total} samples)")
    for name in names.values():
        mine = {c: n for (p, c), n in counts.items() if p == name}
        print(f"{name}: {sum(mine.values()) * per:.2f} us")
        for cat, n in sorted(mine.items(), key=lambda x: -x[1]):
            print(f"  {cat:56} {n * per:5.2f} us")


main()
