"""What a page fault costs this machine: fresh anonymous memory touched one 4 KB page at a time.

    python benchmarks/first_touch.py 1024 3     # 1 GiB, three rounds (each a new mapping)

A cold worker pays one fault per page of its KV pool that a prompt writes first (profile_engine.py counts
them). On a VM, memory the guest has not used since it booted also waits for the host to back it: a round
over more memory than the machine has recycled costs several times one over memory it has, so run this
with a size near the machine's free memory before comparing cold-engine figures across sessions. The loop
runs in Python, about 1 us a page of the figure.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import sys
import time


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mib", type=int, nargs="?", default=1024, help="MiB a round touches")
    p.add_argument("rounds", type=int, nargs="?", default=2)
    ns = p.parse_args()
    if ns.mib < 1 or ns.rounds < 1:
        p.error(f"mib and rounds must be at least 1, got {ns.mib} and {ns.rounds}")
    mib, size = ns.mib, ns.mib << 20
    for r in range(ns.rounds):
        m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        buf = (ctypes.c_char * size).from_buffer(m)
        addr = ctypes.addressof(buf)
        t = time.perf_counter()
        for off in range(0, size, mmap.PAGESIZE):
            ctypes.memset(addr + off, 1, 1)
        per_page = (time.perf_counter() - t) / (size // mmap.PAGESIZE)
        print(f"round {r}: {mib} MiB, {per_page * 1e6:.2f} us a page")
        del buf
        m.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
