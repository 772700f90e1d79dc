"""The s3 backend against a real S3 server (SeaweedFS on 127.0.0.1), and a backend outside the
kvtier package that only configuration names: both run the whole storage contract."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from kvtier.errors import ConfigError, StorageUnavailable
from kvtier.memory.host import HostPool
from kvtier.storage import make_backend, parse_storage
from kvtier.storage.s3.local import ACCESS_KEY, SECRET_KEY
from kvtier.testing.contract import CONTRACT_SPEC, StoreContract, expected_block, make_keys

PLUGINS = Path(__file__).resolve().parents[1] / "plugins"
OBJECT_BYTES = 64 + CONTRACT_SPEC.block_bytes


@pytest.fixture(scope="module")
def credentials(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("s3-credentials") / "credentials"
    path.write_text(
        f"[default]\naws_access_key_id = {ACCESS_KEY}\naws_secret_access_key = {SECRET_KEY}\n"
    )
    path.chmod(0o600)
    return str(path)


def s3_config(server, credentials: str, prefix: str, **options) -> dict:
    return {
        "backend": "s3",
        "endpoint": server.endpoint,
        "bucket": "kvtier-test",
        "prefix": prefix,
        "credentials_file": credentials,
        "timeout_s": 5,
        **options,
    }


def put_blocks(store, pool, keys, first: int = 0) -> list[bool]:
    blocks = [pool.block(first + i) for i in range(len(keys))]
    for key, block in zip(keys, blocks):
        block.copy_(expected_block(key, block.numel()))
    return store.put_from(keys, blocks)


def got_exact(store, pool, keys, first: int = 8) -> list[bool]:
    blocks = [pool.block(first + i) for i in range(len(keys))]
    ok = store.get_into(keys, blocks)
    return [o and torch.equal(b, expected_block(k, b.numel())) for k, b, o in zip(keys, blocks, ok)]


class TestS3Store(StoreContract):
    persistent = True
    multi_process = True
    header_checked_on_exists = False  # lookups answer from the index of the bucket's listing

    @pytest.fixture(autouse=True)
    def _server(self, s3_server, credentials) -> None:
        self.config = s3_config(s3_server, credentials, f"contract-{uuid.uuid4().hex[:12]}")

    def make_store(self, spec):
        return make_backend(spec, self.config)

    def store_config(self) -> dict:
        return self.config


class TestOutsideBackend(StoreContract):
    """Registered by configuration only: ``module`` names where it lives."""

    persistent = True
    multi_process = True
    header_checked_on_exists = False

    @pytest.fixture(autouse=True)
    def _root(self, tmp_path, monkeypatch) -> None:
        monkeypatch.syspath_prepend(str(PLUGINS))
        self.config = {"backend": "outside", "module": "outside_store", "root": str(tmp_path)}

    def make_store(self, spec):
        return make_backend(spec, self.config)

    def store_config(self) -> dict:
        return self.config


def test_an_out_of_tree_module_is_named_in_configuration(tmp_path, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(PLUGINS))
    config = {"backend": "outside", "module": "outside_store", "root": str(tmp_path)}
    assert parse_storage(config).backend == "outside"
    chain = {"tiers": [{"backend": "memory", "capacity_bytes": 1 << 20}, config]}
    with make_backend(CONTRACT_SPEC, chain) as store, HostPool(CONTRACT_SPEC, 16) as pool:
        keys = make_keys(3)
        assert put_blocks(store, pool, keys) == [True] * 3
    assert len(list(tmp_path.iterdir())) == 3  # written through to the outside backend
    with pytest.raises(ConfigError, match="storage.module"):
        parse_storage({"backend": "nowhere", "module": "no_such_module_here"})
    with pytest.raises(ConfigError, match="storage.module"):
        parse_storage({"backend": "x", "module": "os; rm -rf"})
    with pytest.raises(ConfigError, match="storage.module: 'file' is kvtier.storage.file"):
        parse_storage({"backend": "file", "module": "outside_store"})
    with pytest.raises(ConfigError, match=r"storage.tiers\[1\].root"):
        parse_storage({"tiers": [{"backend": "memory"}, {**config, "root": 3}]})


def test_a_restart_finds_its_objects_and_keeps_the_capacity(s3_server, credentials) -> None:
    capacity = 6 * OBJECT_BYTES
    config = s3_config(s3_server, credentials, f"restart-{uuid.uuid4().hex[:12]}")
    config["capacity_bytes"] = capacity
    keys = make_keys(10)
    with HostPool(CONTRACT_SPEC, 16) as pool:
        with make_backend(CONTRACT_SPEC, config) as store:
            evicted: list[str] = []
            store.watch_removals(evicted.extend)
            assert put_blocks(store, pool, keys[:6]) == [True] * 6
            assert put_blocks(store, pool, keys[6:8]) == [True] * 2
            assert evicted == keys[:2]  # least recently used first, told to the listener
            assert store.usage().used_bytes == capacity
        with make_backend(CONTRACT_SPEC, config) as again:  # a new process's view: listed
            assert again.usage().num_objects == 6
            assert again.exists_prefix(keys[2:8]) == 6
            assert got_exact(again, pool, keys[2:8]) == [True] * 6
            assert put_blocks(again, pool, keys[8:10]) == [True] * 2
            usage = again.usage()
            assert usage.used_bytes <= capacity and usage.num_objects == 6
        listed = list(s3_server_objects(s3_server, config["prefix"]))
        assert len(listed) == 6  # capacity held in the bucket itself, not just in the index
    with make_backend(CONTRACT_SPEC, {**config, "capacity_bytes": 3 * OBJECT_BYTES}) as smaller:
        assert smaller.usage().num_objects == 3  # a lower capacity is enforced at open
    assert len(list(s3_server_objects(s3_server, config["prefix"]))) == 3


def s3_server_objects(server, prefix: str):
    import obstore

    for page in obstore.list(server.client("kvtier-test"), prefix=prefix + "/"):
        yield from (meta["path"] for meta in page)


def test_another_writers_objects_are_found_by_a_lookup(s3_server, credentials) -> None:
    config = s3_config(s3_server, credentials, f"shared-{uuid.uuid4().hex[:12]}")
    keys = make_keys(20)
    with HostPool(CONTRACT_SPEC, 16) as pool, make_backend(CONTRACT_SPEC, config) as reader:
        assert reader.exists_prefix(keys) == 0
        with make_backend(CONTRACT_SPEC, config) as writer:
            assert put_blocks(writer, pool, keys[:8]) == [True] * 8
            assert put_blocks(writer, pool, keys[8:16]) == [True] * 8
        assert reader.exists_prefix(keys) == 16  # probed past its index, in parallel
        assert got_exact(reader, pool, keys[:8]) == [True] * 8


def test_a_dead_server_is_unavailable_and_hits_resume_when_it_returns(
    credentials, short_tmp_path
) -> None:
    from conftest import require_s3
    from kvtier.storage.s3.local import LocalS3Server as S3Server

    require_s3()
    server = S3Server(short_tmp_path)
    server.start(bucket="kvtier-test")
    try:
        config = s3_config(server, credentials, "outage", timeout_s=2, retries=1)
        keys = make_keys(4)
        with HostPool(CONTRACT_SPEC, 16) as pool, make_backend(CONTRACT_SPEC, config) as store:
            assert put_blocks(store, pool, keys) == [True] * 4
            server.kill()
            with pytest.raises(StorageUnavailable, match="failed every read"):
                store.get_into(keys, [pool.block(8 + i) for i in range(4)])
            with pytest.raises(StorageUnavailable):
                put_blocks(store, pool, make_keys(2))
            server.start(bucket="kvtier-test")  # the same data directory and ports
            assert got_exact(store, pool, keys) == [True] * 4
    finally:
        server.stop()
    assert not [p for p in server.grpc_sockets() if p.exists()]  # nothing left behind


def test_the_config_names_each_bad_field(tmp_path, s3_server, credentials) -> None:
    base = s3_config(s3_server, credentials, "x")
    for change, field in [
        ({"endpoint": "ftp://h"}, "storage.endpoint"),
        ({"endpoint": "http://10.1.2.3:9000"}, "storage.endpoint"),  # plain HTTP off the host
        ({"bucket": "b"}, "storage.bucket"),
        ({"concurrency": 0}, "storage.concurrency"),
        ({"timeout_s": -1}, "storage.timeout_s"),
        ({"colour": "red"}, "storage.colour"),
    ]:
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            parse_storage({**base, **change})
    parse_storage({**base, "endpoint": "http://10.1.2.3:9000", "allow_http": True})
    loose = tmp_path / "loose"
    loose.write_text(Path(credentials).read_text())
    loose.chmod(0o644)
    with pytest.raises(ConfigError, match="mode 0600"):
        make_backend(CONTRACT_SPEC, {**base, "credentials_file": str(loose)})
    link = tmp_path / "link"
    link.symlink_to(credentials)
    with pytest.raises(ConfigError, match="cannot open"):
        make_backend(CONTRACT_SPEC, {**base, "credentials_file": str(link)})
    with pytest.raises(ConfigError, match="does not exist"):
        make_backend(CONTRACT_SPEC, {**base, "bucket": "no-such-bucket-here"})


def test_wrong_credentials_are_refused_with_the_cause(s3_server, tmp_path) -> None:
    wrong = tmp_path / "wrong"
    wrong.write_text(f"aws_access_key_id = {ACCESS_KEY}\naws_secret_access_key = nope\n")
    wrong.chmod(0o600)
    config = s3_config(s3_server, str(wrong), "denied")
    with pytest.raises(StorageUnavailable, match="PermissionDenied|Unauthenticated|403"):
        store = make_backend(CONTRACT_SPEC, config)
        store.exists_prefix(make_keys(1))
    assert "nope" not in repr(parse_storage(config))


def test_credentials_come_from_the_environment(s3_server, monkeypatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    config = s3_config(s3_server, "unused", f"env-{uuid.uuid4().hex[:8]}")
    del config["credentials_file"]
    with HostPool(CONTRACT_SPEC, 16) as pool, make_backend(CONTRACT_SPEC, config) as store:
        keys = make_keys(2)
        assert put_blocks(store, pool, keys) == [True] * 2
        assert got_exact(store, pool, keys) == [True] * 2


def test_a_chain_over_s3_serves_on_while_s3_is_down(credentials, short_tmp_path, tmp_path) -> None:
    from conftest import require_s3
    from kvtier.storage.s3.local import LocalS3Server as S3Server

    require_s3()
    server = S3Server(short_tmp_path)
    server.start(bucket="kvtier-test")
    try:
        s3 = s3_config(server, credentials, "chain", timeout_s=2, retries=1)
        chain = {
            "tiers": [
                {"backend": "memory", "capacity_bytes": 8 * OBJECT_BYTES},
                {"backend": "file", "root": str(tmp_path / "file")},
                s3,
            ]
        }
        keys = make_keys(4)
        with HostPool(CONTRACT_SPEC, 16) as pool, make_backend(CONTRACT_SPEC, chain) as store:
            assert put_blocks(store, pool, keys) == [True] * 4
            assert store.writer.flush(30) == 0  # written through to every tier
            assert sum(1 for _ in s3_server_objects(server, "chain")) == 4
            server.kill()
            assert got_exact(store, pool, keys) == [True] * 4  # memory and file answer
            assert put_blocks(store, pool, make_keys(2)) == [True] * 2
    finally:
        server.stop()


def test_no_request_leaves_the_loopback(s3_server) -> None:
    """The server the tests start listens on 127.0.0.1 only (every port it opens)."""
    pid = s3_server.process.pid
    listening = []
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[3] == "0A":  # LISTEN
            inode = fields[9]
            local = fields[1].split(":")[0]
            listening.append((inode, local))
    fds = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
    ours = [local for inode, local in listening if f"socket:[{inode}]" in fds]
    assert ours and all(local == "0100007F" for local in ours), ours


def _store_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvtier.ops.cli", "store", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_store_stats_verify_and_gc_work_on_an_s3_store(s3_server, credentials) -> None:
    prefix = f"admin-{uuid.uuid4().hex[:8]}"
    config = s3_config(s3_server, credentials, prefix)
    url = f"s3://kvtier-test/{prefix}"
    where = ["--endpoint", s3_server.endpoint, "--credentials-file", credentials]
    keys, others = make_keys(5, namespace="admin-a"), make_keys(3, namespace="admin-b")
    with HostPool(CONTRACT_SPEC, 16) as pool, make_backend(CONTRACT_SPEC, config) as store:
        assert put_blocks(store, pool, keys) == [True] * 5
        assert put_blocks(store, pool, others) == [True] * 3
        data = bytearray(store.read_object(keys[1]))
        data[-1] ^= 0x01  # the payload's last byte: found by verify only
        store.write_object(keys[1], bytes(data))
    stats = _store_cli("stats", url, *where, "--json")
    assert stats.returncode == 0, stats.stderr
    rows = [json.loads(line) for line in stats.stdout.splitlines()]
    assert {r["namespace"]: r["objects"] for r in rows[:-1]} == {"admin-a": 5, "admin-b": 3}
    verify = _store_cli("verify", url, *where, "--json")
    assert verify.returncode == 1, verify.stderr  # one corrupt, not repaired
    summary = json.loads(verify.stdout)
    assert (summary["sound"], summary["corrupt"]) == (7, 1)
    assert "checksum" in summary["problems"][0]["problem"]
    repaired = _store_cli("verify", url, *where, "--repair", "--json")
    assert json.loads(repaired.stdout)["removed"] == 1
    gc = _store_cli("gc", url, *where, "--namespace", "admin-b", "--json")
    assert gc.returncode == 0, gc.stderr
    assert json.loads(gc.stdout)["removed"] == 3
    assert len(list(s3_server_objects(s3_server, prefix))) == 4
    bad = _store_cli("stats", "s3://", *where)
    assert bad.returncode != 0 and "s3://bucket/prefix" in bad.stderr


def test_a_refresh_of_the_listing_keeps_the_recency_this_process_saw(s3_server, credentials):
    """The index is listed again every ``refresh_s``: objects it knew keep their recency (a
    load made one the most recently used), so capacity still evicts the least recently used."""
    config = s3_config(s3_server, credentials, f"recency-{uuid.uuid4().hex[:8]}")
    config["capacity_bytes"] = 3 * OBJECT_BYTES
    keys = make_keys(4)
    with HostPool(CONTRACT_SPEC, 16) as pool, make_backend(CONTRACT_SPEC, config) as store:
        evicted: list[str] = []
        store.watch_removals(evicted.extend)
        assert put_blocks(store, pool, keys[:3]) == [True] * 3
        assert got_exact(store, pool, keys[:1]) == [True]  # keys[0]: now the most recent
        store._relist()  # what the periodic refresh runs
        assert put_blocks(store, pool, keys[3:]) == [True]
        assert evicted == [keys[1]]
        assert store.exists_prefix(keys[:1]) == 1


def test_a_sigkilled_starter_leaves_no_s3_server_behind(short_tmp_path) -> None:
    from conftest import require_s3

    require_s3()
    code = (
        "import sys; from pathlib import Path; from kvtier.storage import LocalS3Server\n"
        "s = LocalS3Server(Path(sys.argv[1])); s.start(bucket='kvtier-test')\n"
        "print(s.process.pid, *s.grpc_sockets(), flush=True); sys.stdin.read()\n"
    )
    starter = subprocess.Popen(
        [sys.executable, "-c", code, str(short_tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        pid, *sockets = starter.stdout.readline().split()
        weed = int(pid)
    finally:
        starter.kill()
        starter.wait()
    deadline = time.monotonic() + 10
    while Path(f"/proc/{weed}").exists() and _state(weed) != "Z":
        assert time.monotonic() < deadline, "weed outlived its SIGKILLed starter"
        time.sleep(0.05)
    for path in sockets:  # SeaweedFS's own, in /tmp: a killed weed cannot remove them
        Path(path).unlink(missing_ok=True)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "Z"
