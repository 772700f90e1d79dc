"""S3Config: the s3 backend's options, validated; errors name ``storage.<field>``.

Credentials come from ``credentials_file`` (a regular file of this user, mode 0600, checked on
the descriptor, in the AWS shared-credentials form: ``aws_access_key_id = ...`` and
``aws_secret_access_key = ...``, optionally under a ``[profile]``) or else from the usual
environment (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``). They are
read when the store opens, never logged, never part of ``describe``. TLS is the endpoint's
scheme: ``https://`` verifies the server's certificate (``ca_file`` adds a private CA);
``http://`` is plain and accepted only for a loopback endpoint unless ``allow_http`` says so.
"""

from __future__ import annotations

import configparser
import ipaddress
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from kvtier.common.config_sources import positive, refuse_unknown
from kvtier.errors import ConfigError
from kvtier.transport.auth import read_private_file

OPTIONS = (
    "backend",
    "endpoint",
    "bucket",
    "prefix",
    "region",
    "credentials_file",
    "profile",
    "ca_file",
    "allow_http",
    "capacity_bytes",
    "concurrency",
    "retries",
    "timeout_s",
    "refresh_s",
)
MAX_CREDENTIALS_FILE_BYTES = 64 << 10
# An S3 object name is at most 1024 bytes; a key is at most 512 (the file store's bound too).
MAX_PREFIX_BYTES = 256


@dataclass(frozen=True)
class Credentials:
    access_key_id: str
    secret_access_key: str = field(repr=False)
    session_token: str | None = field(default=None, repr=False)


@dataclass(frozen=True)
class S3Config:
    endpoint: str
    bucket: str
    prefix: str = "kvtier"
    region: str = "us-east-1"
    credentials_file: str | None = None
    profile: str = "default"
    ca_file: str | None = None
    allow_http: bool = False
    capacity_bytes: int | None = None
    concurrency: int = 16  # requests in flight per batch
    retries: int = 3  # per request, with backoff; then the request fails with the cause
    timeout_s: float = 10.0  # per request: a stuck server fails a batch, it never hangs it
    # How often the index of what the bucket holds is listed again: objects other writers put
    # there are seen at the latest then (a lookup probes the first unknown key at once).
    refresh_s: float = 60.0

    @property
    def tls(self) -> bool:
        return urlsplit(self.endpoint).scheme == "https"

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> S3Config:
        refuse_unknown(data, OPTIONS, "storage.", "option for the s3 backend")
        endpoint = data.get("endpoint") or os.environ.get("AWS_ENDPOINT_URL")
        if not isinstance(endpoint, str) or not endpoint:
            raise ConfigError("storage.endpoint", "names the S3 server: http(s)://host:port")
        url = urlsplit(endpoint)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ConfigError("storage.endpoint", f"got {endpoint!r}; need http(s)://host[:port]")
        allow_http = data.get("allow_http", False)
        if not isinstance(allow_http, bool):
            raise ConfigError("storage.allow_http", "must be true or false")
        if url.scheme == "http" and not allow_http and not _loopback(url.hostname):
            raise ConfigError(
                "storage.endpoint",
                f"{endpoint} is plain HTTP to another host: use https:// (or allow_http: true "
                "where the network is trusted)",
            )
        bucket = data.get("bucket")
        if not isinstance(bucket, str) or not 3 <= len(bucket) <= 63:
            raise ConfigError(
                "storage.bucket", f"must be a bucket name (3-63 chars), got {bucket!r}"
            )
        prefix = data.get("prefix", "kvtier")
        if not isinstance(prefix, str) or len(prefix.encode()) > MAX_PREFIX_BYTES:
            raise ConfigError("storage.prefix", f"must be a string of <= {MAX_PREFIX_BYTES} bytes")
        options: dict[str, Any] = {"endpoint": endpoint.rstrip("/"), "bucket": bucket}
        options["prefix"] = prefix.strip("/")
        options["allow_http"] = allow_http
        for name in ("region", "credentials_file", "profile", "ca_file"):
            value = data.get(name)
            if value is not None:
                if not isinstance(value, str) or not value:
                    raise ConfigError(
                        f"storage.{name}", f"must be a non-empty string, got {value!r}"
                    )
                options[name] = value
        for name in ("capacity_bytes", "concurrency", "retries"):
            if data.get(name) is not None:
                positive(f"storage.{name}", data[name], integer=True)
                options[name] = data[name]
        for name in ("timeout_s", "refresh_s"):
            if name in data:
                positive(f"storage.{name}", data[name])
                options[name] = float(data[name])
        if options.get("concurrency", 1) > 256:
            raise ConfigError("storage.concurrency", "must be at most 256")
        return cls(**options)

    def credentials(self) -> Credentials | None:
        """From ``credentials_file``, else the environment; None: anonymous requests."""
        if self.credentials_file is not None:
            return read_credentials(self.credentials_file, self.profile)
        key = os.environ.get("AWS_ACCESS_KEY_ID")
        secret = os.environ.get("AWS_SECRET_ACCESS_KEY")
        if not key or not secret:
            return None
        return Credentials(key, secret, os.environ.get("AWS_SESSION_TOKEN") or None)


def read_credentials(path: str, profile: str = "default") -> Credentials:
    """The keys in ``path``: a regular file of this user with no group/other access."""
    field_name = "storage.credentials_file"
    raw = read_private_file(path, field_name, MAX_CREDENTIALS_FILE_BYTES)
    text = raw.decode("utf-8", errors="replace")
    parser = configparser.ConfigParser(interpolation=None)
    try:
        parser.read_string(text if text.lstrip().startswith("[") else f"[{profile}]\n{text}")
    except configparser.Error:
        raise ConfigError(field_name, f"{path} is not in the AWS credentials form") from None
    if not parser.has_section(profile):
        raise ConfigError(f"{field_name}", f"{path} has no [{profile}] profile (storage.profile)")
    section = parser[profile]
    key, secret = section.get("aws_access_key_id"), section.get("aws_secret_access_key")
    if not key or not secret:
        raise ConfigError(
            field_name, f"{path} [{profile}] needs aws_access_key_id and aws_secret_access_key"
        )
    return Credentials(key.strip(), secret.strip(), (section.get("aws_session_token") or None))


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
