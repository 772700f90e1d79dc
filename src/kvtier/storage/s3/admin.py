"""`kvtier store stats|verify|gc` on an s3 store (``s3://bucket/prefix``): the same tables as
on a file store, from a listing of the bucket (stats and gc read no object) and, for verify,
every object fetched and checked (header against its key, checksum, MAC with the key file).

An object's key is its name (``<prefix>/<key>``, %-escaped), so its namespace, weight version
and layout come from the listing; the last-used time is the object's last-modified time (S3
keeps no access times: a store that runs keeps its own recency, ``kvtier.storage.s3.store``).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import PurePosixPath
from urllib.parse import urlsplit

from kvtier.errors import ConfigError, ObjectCorrupt
from kvtier.layout.keys import KeyScheme
from kvtier.storage.file.admin import StoredObject
from kvtier.storage.format import HEADER_BYTES, PLAIN, ObjectFormat, checksum_of, read_header
from kvtier.storage.s3.client import RequestFailed, S3Client
from kvtier.storage.s3.config import S3Config

VERIFY_THREADS = 16


class S3Object(StoredObject):
    """A listed object: its layout from its key until its header is read."""

    @property
    def fingerprint(self) -> str:
        if self.header is not None:
            return self.header.fingerprint
        return self.parts.fingerprint if self.parts else "?"


class S3Target:
    """The objects under ``s3://bucket/prefix`` at ``endpoint``."""

    def __init__(self, url: str, endpoint: str | None, credentials_file: str | None) -> None:
        parts = urlsplit(url)
        if parts.scheme != "s3" or not parts.netloc:
            raise ConfigError("root", f"got {url!r}; an s3 store is s3://bucket/prefix")
        options = {"backend": "s3", "bucket": parts.netloc, "prefix": parts.path.strip("/")}
        if endpoint:
            options["endpoint"] = endpoint
        if credentials_file:
            options["credentials_file"] = credentials_file
        self.config = S3Config.from_dict(options)
        self.client = S3Client(self.config)

    def scan(self) -> list[S3Object]:
        found = []
        for mtime, key, size in self.client.list():
            parts = KeyScheme.parse(key)
            name = PurePosixPath(self.client.path(key))
            if parts is None:
                found.append(S3Object(name, size, mtime, problem="not a kvtier key", foreign=True))  # type: ignore[arg-type]
            else:
                found.append(S3Object(name, size, mtime, key=key, parts=parts))  # type: ignore[arg-type]
        return found

    def verify_all(
        self,
        objects: list[S3Object],
        mac_key: bytes | None,
        progress: Callable[[int, int], None] | None = None,
    ) -> list[S3Object]:
        own = [o for o in objects if not o.foreign]
        with ThreadPoolExecutor(VERIFY_THREADS) as pool:
            for i, _ in enumerate(pool.map(lambda o: self._verify(o, mac_key), own), 1):
                if progress is not None:
                    progress(i, len(own))
        return objects

    def _verify(self, found: S3Object, mac_key: bytes | None) -> None:
        assert found.key is not None and found.parts is not None
        try:
            data = self.client.get(found.key)
        except RequestFailed as e:
            found.problem = f"could not be read: {e}"
            return
        if data is None:
            found.problem = "removed while checking"
            return
        try:
            if len(data) < HEADER_BYTES:
                raise ObjectCorrupt(f"object is {len(data)} bytes: no header")
            raw = bytes(data[:HEADER_BYTES])
            header = read_header(raw)
            found.header = header
            payload = data[HEADER_BYTES : HEADER_BYTES + header.payload_length]
            if header.version != PLAIN and mac_key is None:  # the checksum still covers it
                if checksum_of([payload]) != header.checksum:
                    raise ObjectCorrupt("payload checksum mismatch")
                return
            fmt = ObjectFormat(
                found.parts.fingerprint, mac_key if header.version != PLAIN else None
            )
            fmt.check(raw, [payload], found.key, len(payload))
        except ObjectCorrupt as e:
            found.problem = str(e)
        except ValueError as e:  # a header too short or malformed to unpack
            found.problem = f"malformed header: {e}"

    def remove(self, found: S3Object) -> bool:
        if found.foreign or found.key is None:
            raise ConfigError("root", f"refusing to remove {found.path}: not an object of kvtier")
        self.client.delete([found.key])
        return True
