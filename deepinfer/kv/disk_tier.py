"""The disk tier of the prefix cache: evicted KV blocks as files that survive a restart.

Layout: <dir>/<salt[:16]>/<key[:2]>/<key>.kvb, where both names are hex. The salt (the model fingerprint,
dtype and block size; engine/startup.py `cache_salt`) is in the path and in each file's header, so
another model, dtype or block size never reads these blocks.

A file is, in order:
- the magic b"DIKV1\\n";
- a little-endian uint32 header length;
- a JSON header: key, salt, the parts' dtypes and shapes, the payload's sha256;
- the payload: the block's tensors, raw, one part after another.

Reading checks the magic, the key, the salt, the shapes and the checksum. A file that fails any of these
is a miss: it is logged as a warning and removed, and wrong KV is never returned.

Writes are atomic: a temporary file in the same directory, fsync, then os.replace. A crash mid-write
leaves at worst a stray temporary file and never a block that reads back wrong. Two servers sharing the
directory write identical bytes for one key, and each rename is atomic, so they cannot corrupt each
other.

Limits are kept by `sweep()` (at start and every SWEEP_EVERY puts): files older than the retention go
first, then the least recently used (by mtime; a read touches its file) until the size limit holds.
Temporary files older than an hour are removed.

Asynchronous I/O, so the scheduler never waits on the file system:
- writes: `put` queues the block for one writer thread (at most MAX_QUEUED blocks: a full queue makes put
  wait, the back-pressure of a disk slower than the evictions); the writer first waits for the block's device
  -> host copy (`ready`), then writes the file atomically as above. Until written, a queued block counts as
  held (`contains`) and is served from memory (`get`; a copy when the memory is a host tier slot, which is
  released to the host tier once written). Nothing in the engine waits for the queue: the writer drains it in
  the background (an engine going idle used to wait for it, and the next request's TTFT paid the fsyncs: ~120-270
  ms after a 2k-token hit on the cpu backend). The files are complete when they are needed: `flush()` waits for
  the queue; a DiskTier opened on a directory first flushes this process's other tiers on it (a restarted
  engine in the same process finds every block its predecessor queued); the finalizer (also at interpreter
  exit) lets the writer finish what is queued.
- reads: `read_async` reads and checks a file on a small thread pool into host buffers from `alloc` (pinned
  on a GPU, so the copy up is asynchronous); the link starts them at schedule time and the scheduler admits
  the sequence once they are done (tier_link.py).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import struct
import tempfile
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch

logger = logging.getLogger("deepinfer")

MAGIC = b"DIKV1\n"
SUFFIX = ".kvb"
SWEEP_EVERY = 64
MAX_QUEUED = 256  # blocks waiting for the writer thread
READ_THREADS = 2
_DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn)}
_OPEN: weakref.WeakSet = weakref.WeakSet()  # this process's disk tiers (a new one on a directory flushes the others)


class DiskTier:
    def __init__(self, directory: str, max_bytes: int, retention_hours: float, salt: bytes,
                 alloc: Callable[[tuple, torch.dtype], torch.Tensor] | None = None):
        if max_bytes < 1:
            raise ValueError(f"kv disk cache size must be positive, got {max_bytes} bytes")
        self.salt = salt
        self.root = os.path.join(os.path.abspath(directory), salt.hex()[:16])
        os.makedirs(self.root, exist_ok=True)
        self.max_bytes = max_bytes
        self.retention_s = retention_hours * 3600.0
        self.alloc = alloc or (lambda shape, dtype: torch.empty(shape, dtype=dtype))
        self.puts = self.hits = self.misses = self.corrupt = 0
        for other in list(_OPEN):  # this process's queued writes to this directory land before it is read
            if other.root == self.root:
                other.flush()
        _OPEN.add(self)
        self.sweep()
        self._lock = threading.Lock()
        self._queued: dict[bytes, list[torch.Tensor]] = {}  # put, not yet written
        self._borrowed: dict[bytes, object] = {}  # queued blocks in borrowed memory (host tier slots): their ready
        self._queue: queue.Queue = queue.Queue(MAX_QUEUED)
        self._writer = threading.Thread(target=_write_loop, args=(self._queue, weakref.ref(self)), daemon=True,
                                        name="deepinfer-kv-disk-writer")
        self._writer.start()
        self._reads: ThreadPoolExecutor | None = None
        weakref.finalize(self, _stop, self._queue, self._writer)

    def use_allocator(self, alloc: Callable[[tuple, torch.dtype], torch.Tensor]) -> None:
        """Where reads put blocks (the link's copy buffers: pinned on a GPU, so the copy up is asynchronous)."""
        self.alloc = alloc

    def _path(self, key: bytes) -> str:
        h = key.hex()
        return os.path.join(self.root, h[:2], h + SUFFIX)

    def contains(self, key: bytes) -> bool:
        with self._lock:
            if key in self._queued:
                return True
        return os.path.exists(self._path(key))

    def put(self, key: bytes, parts: list[torch.Tensor], ready: Callable[[], None] | None = None,
            release: Callable[[], None] | None = None) -> None:
        """Queue the block for the writer (host parts, filled once ready() returns; parts on a device are copied
        down now). release: the parts are borrowed (a host tier slot): called once they are no longer read (written,
        failed, or not needed), after which their memory may change."""
        path = self._path(key)
        with self._lock:
            queued = key in self._queued
        if queued or os.path.exists(path):
            if not queued:
                os.utime(path)
            if release is not None:
                release()
            return
        host = [p.detach() if p.device.type == "cpu" else p.detach().to("cpu") for p in parts]
        with self._lock:
            self._queued[key] = host
            if release is not None:
                self._borrowed[key] = ready
        self.puts += 1
        self._queue.put((key, host, ready, release))

    def flush(self) -> None:
        """Wait until every queued block is written."""
        self._queue.join()

    def _write(self, key: bytes, host: list[torch.Tensor]) -> None:
        """On the writer thread: one file, atomically."""
        path = self._path(key)
        host = [t.contiguous() for t in host]
        payload = b"".join(t.view(torch.uint8).numpy().tobytes() for t in host)
        header = json.dumps({"key": key.hex(), "salt": self.salt.hex(),
                             "parts": [[str(t.dtype), list(t.shape)] for t in host],
                             "sha256": hashlib.sha256(payload).hexdigest()}).encode()
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=os.path.dirname(path))
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(MAGIC + struct.pack("<I", len(header)) + header + payload)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    def _written(self, key: bytes, count: int, release: Callable[[], None] | None = None) -> None:
        with self._lock:
            self._queued.pop(key, None)
            self._borrowed.pop(key, None)
            if release is not None:  # under the lock: a get() copying the borrowed parts has finished
                release()
        if count % SWEEP_EVERY == 0:
            self.sweep()

    def get(self, key: bytes, like: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """The block's parts (host tensors shaped and typed like `like`), or None on a miss or a bad file."""
        with self._lock:
            queued = self._queued.get(key)
            borrowed = key in self._borrowed
            ready = self._borrowed.get(key)
            if queued is not None and borrowed:  # a host tier slot, freed once written: copy it while held
                if ready is not None:
                    ready()
                queued = [t.clone() for t in queued]
        if queued is not None:
            if [(t.dtype, t.shape) for t in queued] != [(t.dtype, t.shape) for t in like]:
                self.misses += 1
                return None
            self.hits += 1
            return queued
        return self._read(key, like)

    def read_async(self, key: bytes, like: list[torch.Tensor]) -> Future:
        """get() on the read pool (a queued block resolves at once)."""
        with self._lock:
            queued = key in self._queued
        if queued:
            f: Future = Future()
            f.set_result(self.get(key, like))
            return f
        if self._reads is None:
            self._reads = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="deepinfer-kv-disk-read")
        return self._reads.submit(self._read, key, like)

    def _read(self, key: bytes, like: list[torch.Tensor]) -> list[torch.Tensor] | None:
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                data = bytearray(f.read())
        except FileNotFoundError:
            self.misses += 1
            return None
        parts = self._decode(data, key, like)
        if parts is None:
            self.corrupt += 1
            logger.warning("kv disk cache: %s failed its checks; treated as a miss and removed", path)
            _unlink(path)
            return None
        try:
            os.utime(path)
        except FileNotFoundError:  # swept meanwhile: what was read is checked and right
            pass
        self.hits += 1
        return parts

    def _decode(self, data: bytearray, key: bytes, like: list[torch.Tensor]) -> list[torch.Tensor] | None:
        if not data.startswith(MAGIC) or len(data) < len(MAGIC) + 4:
            return None
        (n,) = struct.unpack("<I", data[len(MAGIC): len(MAGIC) + 4])
        start = len(MAGIC) + 4
        try:
            header = json.loads(data[start: start + n])
        except ValueError:
            return None
        payload = memoryview(data)[start + n:]
        if header.get("key") != key.hex() or header.get("salt") != self.salt.hex():
            return None
        if hashlib.sha256(payload).hexdigest() != header.get("sha256"):
            return None
        want = [[str(t.dtype), list(t.shape)] for t in like]
        if header.get("parts") != want:
            return None
        out, off = [], 0
        for t in like:
            nbytes = t.numel() * t.element_size()
            if off + nbytes > len(payload):
                return None
            buf = self.alloc(tuple(t.shape), _DTYPES[str(t.dtype)])
            buf.view(-1).view(torch.uint8).copy_(torch.frombuffer(payload, dtype=torch.uint8, offset=off, count=nbytes))
            out.append(buf)
            off += nbytes
        return out if off == len(payload) else None

    def sweep(self) -> None:
        """Enforce the retention and the size limit; drop stale temporary files."""
        now = time.time()
        files = []
        for dirpath, _, names in os.walk(self.root):
            for name in names:
                p = os.path.join(dirpath, name)
                try:
                    st = os.stat(p)
                except FileNotFoundError:
                    continue
                if name.startswith(".tmp-"):
                    if now - st.st_mtime > 3600:
                        _unlink(p)
                    continue
                if not name.endswith(SUFFIX):
                    continue
                if now - st.st_mtime > self.retention_s:
                    _unlink(p)
                    continue
                files.append((st.st_mtime, st.st_size, p))
        total = sum(size for _, size, _ in files)
        for _, size, p in sorted(files):
            if total <= self.max_bytes:
                break
            _unlink(p)
            total -= size

    def size_bytes(self) -> int:
        return sum(os.path.getsize(os.path.join(d, n)) for d, _, ns in os.walk(self.root) for n in ns
                   if n.endswith(SUFFIX))


def _write_loop(q: queue.Queue, tier_ref) -> None:
    """The writer thread: holds only the queue and a weak reference, so a dropped tier is collected (and its
    finalizer stops this loop). A failed write is logged and the block is left out (a miss later, never
    wrong KV)."""
    count = 0
    while True:
        item = q.get()
        try:
            if item is None:
                return
            key, host, ready, release = item
            tier = tier_ref()
            if tier is None:
                if release is not None:
                    release()
                return
            try:
                if ready is not None:
                    ready()
                tier._write(key, host)
            except Exception:  # noqa: BLE001 - a full or failing disk loses this block, not the engine
                logger.exception("kv disk cache: writing block %s failed; it is not cached on disk", key.hex()[:16])
            count += 1
            tier._written(key, count, release)
            del tier
        finally:
            q.task_done()


def _stop(q: queue.Queue, writer: threading.Thread) -> None:
    """The tier is gone or the interpreter exits: end the writer after what is queued, and wait for it (a
    thread still running at interpreter shutdown can abort the process)."""
    try:
        q.put(None, timeout=60)
    except queue.Full:  # a writer that already ended (its tier gone) drains nothing
        return
    if writer is not threading.current_thread():
        writer.join(timeout=60)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
