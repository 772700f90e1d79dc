"""The S3 requests the s3 backend makes, through obstore (Rust's ``object_store``: one HTTP/1.1
connection pool, SigV4 signing, retries with backoff, all outside the GIL).

Why obstore: measured here against SeaweedFS on loopback (docs/storage.md, "The s3 backend"),
16 requests in flight, its gets ran 4.3x (256 KiB objects) and 2.4x (1 MiB) boto3's and its
puts 2.2x and 1.3x; it is one wheel with no native dependency (NIXL's OBJ plugin speaks the same
S3 but needs its UCX build and an agent per process).

Every request is bounded: ``timeout_s`` per attempt, ``retries`` attempts with backoff, and all
of them within ``timeout_s x (retries + 1)``; then it fails with the server's answer or the
connection error in the message. A missing object is ``None``, never an error.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import Any
from urllib.parse import quote, unquote

from kvtier.errors import ConfigError, StorageUnavailable
from kvtier.storage.s3.config import S3Config

# Characters a key keeps in its object name (the rest are %-escaped: names stay reversible).
KEY_SAFE = ":-_.~"
LIST_CHUNK = 1000  # one ListObjectsV2 page


class RequestFailed(Exception):
    """One request failed after its retries (the message names the cause)."""


def import_obstore():
    try:
        # local: obstore is the optional extra kvtier[s3]; its absence is a ConfigError saying so
        import obstore

        # local: as above
        from obstore.store import S3Store as ObjectStore
    except ImportError:
        raise ConfigError(
            "storage.backend", "the s3 backend needs obstore: pip install 'kvtier[s3]'"
        ) from None
    return obstore, ObjectStore


class S3Client:
    """One bucket under one prefix: object names from keys and back, and the five requests."""

    def __init__(self, config: S3Config) -> None:
        self.obstore, object_store = import_obstore()
        self.config = config
        self.root = f"{config.prefix}/" if config.prefix else ""
        store_config: dict[str, Any] = {"endpoint": config.endpoint, "region": config.region}
        credentials = config.credentials()
        if credentials is not None:
            store_config["access_key_id"] = credentials.access_key_id
            store_config["secret_access_key"] = credentials.secret_access_key
            if credentials.session_token:
                store_config["session_token"] = credentials.session_token
        else:
            store_config["skip_signature"] = True
        timeout = timedelta(seconds=config.timeout_s)
        client: dict[str, Any] = {
            "allow_http": config.endpoint.startswith("http://"),
            "timeout": timeout,
            "connect_timeout": min(timeout, timedelta(seconds=3)),
            "pool_max_idle_per_host": str(config.concurrency),
        }
        if config.ca_file is not None:
            client["root_certificate"] = config.ca_file
        retry = {
            "max_retries": config.retries,
            "retry_timeout": timeout * (config.retries + 1),
            "backoff": {
                "init_backoff": timedelta(milliseconds=50),
                "max_backoff": timedelta(seconds=2),
                "base": 2,
            },
        }
        self.store = object_store(
            config.bucket,
            config=store_config,
            client_options=client,
            retry_config=retry,
            virtual_hosted_style_request=False,
        )

    # ---- names --------------------------------------------------------------------------------

    def path(self, key: str) -> str:
        return self.root + quote(key, safe=KEY_SAFE)

    def key(self, path: str) -> str | None:
        if not path.startswith(self.root):
            return None
        return unquote(path[len(self.root) :])

    # ---- requests -----------------------------------------------------------------------------

    def get(self, key: str) -> memoryview | None:
        """The object's bytes, or None when there is none."""
        try:
            return memoryview(self.obstore.get(self.store, self.path(key)).bytes())
        except FileNotFoundError:
            return None
        except Exception as e:  # obstore's errors and the OS's: the message names the cause
            raise RequestFailed(_first_line(e)) from None

    def head(self, key: str) -> int | None:
        """The object's size, or None when there is none."""
        try:
            return int(self.obstore.head(self.store, self.path(key))["size"])
        except FileNotFoundError:
            return None
        except Exception as e:
            raise RequestFailed(_first_line(e)) from None

    def put(self, key: str, body: Sequence[Any], create: bool = True) -> bool:
        """Store ``body`` (buffers, joined) under ``key``. ``create``: only if there is no
        object yet (a conditional put: False when one exists, which is then kept)."""
        data = body[0] if len(body) == 1 else b"".join(body)
        try:
            self.obstore.put(
                self.store,
                self.path(key),
                data,
                mode="create" if create else "overwrite",
                use_multipart=False,
            )
            return True
        except FileExistsError:
            return False
        except Exception as e:
            if type(e).__name__ in ("AlreadyExistsError", "PreconditionError"):
                return False
            raise RequestFailed(_first_line(e)) from None

    def delete(self, keys: Sequence[str]) -> None:
        """Remove the objects of ``keys`` (missing ones are ignored), in bulk requests."""
        if not keys:
            return
        try:
            self.obstore.delete(self.store, [self.path(k) for k in keys])
        except FileNotFoundError:
            pass
        except Exception as e:
            raise RequestFailed(_first_line(e)) from None

    def list(self) -> Iterator[tuple[float, str, int]]:
        """(modified time, key, bytes) of every object under the prefix, a page at a time."""
        try:
            for page in self.obstore.list(
                self.store, prefix=self.root or None, chunk_size=LIST_CHUNK
            ):
                for meta in page:
                    key = self.key(meta["path"])
                    if key is not None:
                        yield meta["last_modified"].timestamp(), key, int(meta["size"])
        except Exception as e:
            if isinstance(e, FileNotFoundError) or "NoSuchBucket" in str(e):
                raise ConfigError(
                    "storage.bucket",
                    f"{self.config.bucket!r} does not exist at {self.config.endpoint}: create it",
                ) from None
            raise StorageUnavailable(
                f"the S3 server at {self.config.endpoint} cannot list bucket "
                f"{self.config.bucket!r}: {_first_line(e)}"
            ) from None


def _first_line(error: BaseException) -> str:
    """obstore's messages carry a debug dump after the first line; the first names the cause."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"
