"""Host memory as a backend reports it: the CPU backend's KV budget, and interpreter-mode backends'."""

from __future__ import annotations

import os


def host_memory_info() -> tuple[int, int]:
    """(available, total) host memory from /proc/meminfo; os.sysconf where that file is absent."""
    try:
        fields: dict[str, int] = {}
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts:
                    fields[key] = int(parts[0]) * 1024  # values are in kB
        total = fields["MemTotal"]
        free = fields.get("MemAvailable", fields.get("MemFree", 0))
        return free, total
    except (OSError, KeyError, ValueError):
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page
