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
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import tempfile
import time

import torch

logger = logging.getLogger("deepinfer")

MAGIC = b"DIKV1\n"
SUFFIX = ".kvb"
SWEEP_EVERY = 64
_DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn)}


class DiskTier:
    def __init__(self, directory: str, max_bytes: int, retention_hours: float, salt: bytes):
        if max_bytes < 1:
            raise ValueError(f"kv disk cache size must be positive, got {max_bytes} bytes")
        self.salt = salt
        self.root = os.path.join(os.path.abspath(directory), salt.hex()[:16])
        os.makedirs(self.root, exist_ok=True)
        self.max_bytes = max_bytes
        self.retention_s = retention_hours * 3600.0
        self.puts = self.hits = self.misses = self.corrupt = 0
        self.sweep()

    def _path(self, key: bytes) -> str:
        h = key.hex()
        return os.path.join(self.root, h[:2], h + SUFFIX)

    def contains(self, key: bytes) -> bool:
        return os.path.exists(self._path(key))

    def put(self, key: bytes, parts: list[torch.Tensor]) -> None:
        path = self._path(key)
        if os.path.exists(path):
            os.utime(path)
            return
        host = [p.detach().to("cpu").contiguous() for p in parts]
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
        self.puts += 1
        if self.puts % SWEEP_EVERY == 0:
            self.sweep()

    def get(self, key: bytes, like: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """The block's parts (host tensors shaped and typed like `like`), or None on a miss or a bad file."""
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            self.misses += 1
            return None
        parts = self._decode(data, key, like)
        if parts is None:
            self.corrupt += 1
            logger.warning("kv disk cache: %s failed its checks; treated as a miss and removed", path)
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            return None
        os.utime(path)
        self.hits += 1
        return parts

    def _decode(self, data: bytes, key: bytes, like: list[torch.Tensor]) -> list[torch.Tensor] | None:
        if not data.startswith(MAGIC) or len(data) < len(MAGIC) + 4:
            return None
        (n,) = struct.unpack("<I", data[len(MAGIC): len(MAGIC) + 4])
        start = len(MAGIC) + 4
        try:
            header = json.loads(data[start: start + n])
        except ValueError:
            return None
        payload = data[start + n:]
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
            raw = torch.frombuffer(bytearray(payload[off: off + nbytes]), dtype=torch.uint8)
            out.append(raw.view(_DTYPES[str(t.dtype)]).view(t.shape))
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


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
