"""Restore measurement: what each restore cost the server, measured inside its process
(`kvpack serve --measure-restores`, read on GET /v1/admin/restores; `kvpack bench` reads
the restore rate and the memory target from it).

- restore record (RestoreRecord): one lookup that installed state from a tier — the
  tier, the tokens it supplied, the restore seconds and bytes from the ladder's
  committed-restore receipt (kvpack/tiers/ladder.py's Installed), the resident set size
  (RSS) before it, and the peak RSS above that while it ran (`peak_rss_added`).
- peak RSS: on Linux the kernel's high-water mark (VmHWM in /proc/self/status), reset to
  the current RSS by writing "5" to /proc/self/clear_refs just before the restore; so the
  peak is exact, not sampled. It counts memory newly made resident: memory the process
  already held (freed by earlier work and kept by the allocator) that the restore reuses
  is not added. Elsewhere the peak is None (not measured) and says so.
- RestoreMeter: wraps the ladder's serve; records restores (not misses, not session
  continuations), the last `capacity` of them, oldest first. It is process-wide (RSS is),
  so it measures one restore at a time: the engine thread runs one lookup at a time.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvpack.tiers.ladder import Installed

DEFAULT_CAPACITY = 1000
_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")
_NOT_RESTORES = frozenset({"none", "session"})


@dataclass(frozen=True)
class RestoreRecord:
    tier: str
    depth: int  # tokens the tier supplied
    seconds: float  # the receipt's restore seconds (fetch + verify + install)
    bytes: int  # billed from the manifest (durable, remote) or estimated (resident)
    rss_before: int | None  # bytes
    peak_rss_added: int | None  # bytes above rss_before at the peak; None: not measured

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _status_bytes(field: str) -> int | None:
    """A "<field>: <n> kB" line of /proc/self/status, in bytes; None where there is none."""
    try:
        text = _STATUS.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    return None


def reset_peak() -> bool:
    """Reset the kernel's RSS high-water mark to the current RSS; False where it cannot."""
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return True


class RestoreMeter:
    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self._records: deque[RestoreRecord] = deque(maxlen=capacity)
        self._lock = threading.Lock()

    def measure(self, serve: Callable[[], Installed]) -> Installed:
        """Run the ladder's `serve` and record it when a tier restored state."""
        peak_known = reset_peak()
        before = _status_bytes("VmRSS")
        installed = serve()
        peak = _status_bytes("VmHWM") if peak_known else None
        if installed.tier not in _NOT_RESTORES:
            added = None if peak is None or before is None else max(0, peak - before)
            record = RestoreRecord(
                tier=installed.tier,
                depth=installed.depth,
                seconds=installed.restore_seconds,
                bytes=installed.restore_bytes,
                rss_before=before,
                peak_rss_added=added,
            )
            with self._lock:
                self._records.append(record)
        return installed

    def records(self) -> list[RestoreRecord]:
        with self._lock:
            return list(self._records)
