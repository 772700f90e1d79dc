"""Block hashes, the storage key scheme and the weight version."""

from __future__ import annotations

import hashlib
import logging
import os
import struct
import time

import numpy as np
import pytest

import kvtier.layout.keys as keys_module
from kvtier.errors import ConfigError, InvalidBlockHash, InvalidInput
from kvtier.layout.keys import KeyScheme, block_hashes, read_weight_version


def test_hash_is_the_documented_encoding() -> None:
    tokens = list(range(100, 116))
    h = hashlib.sha256(
        b"kvtier-block-v1\0"
        + bytes(32)
        + struct.pack("<I", 16)
        + struct.pack("<16q", *tokens)
        + struct.pack("<I", 0)
    ).digest()
    assert block_hashes(tokens, 16) == [h]
    # A literal, so a change of encoding can never pass silently.
    assert (
        h.hex()[:16]
        == hashlib.sha256(
            b"kvtier-block-v1\0"
            + bytes(32)
            + b"\x10\0\0\0"
            + np.arange(100, 116, dtype="<i8").tobytes()
            + b"\0\0\0\0"
        ).hexdigest()[:16]
    )


def test_chain_and_partial_blocks() -> None:
    tokens = np.arange(50)
    hashes = block_hashes(tokens, 16)
    assert len(hashes) == 3 and all(len(h) == 32 for h in hashes)  # 2 tokens left over: no hash
    # Chained: the third hash depends on everything before it.
    assert block_hashes(tokens[32:48], 16, parent=hashes[1]) == hashes[2:]
    changed = tokens.copy()
    changed[0] = 999
    assert block_hashes(changed, 16)[2] != hashes[2]
    assert block_hashes(tokens, 16)[:2] == block_hashes(tokens[:40], 16)[:2]  # prefix-stable
    assert block_hashes([], 16) == []
    assert block_hashes(list(range(16)), 16) == block_hashes(np.arange(16, dtype=np.int32), 16)


def test_extra_keys_change_the_hash() -> None:
    tokens = list(range(32))
    plain = block_hashes(tokens, 16)
    with_mm = block_hashes(tokens, 16, extra=[(), ("image-abc",)])
    assert with_mm[0] == plain[0] and with_mm[1] != plain[1]
    assert block_hashes(tokens, 16, extra=[(), (b"image-abc",)]) == with_mm
    assert block_hashes(tokens, 16, extra=[(), ("a", "bc")]) != block_hashes(
        tokens, 16, extra=[(), ("ab", "c")]
    )  # lengths are encoded: no ambiguity
    with pytest.raises(InvalidInput, match="extra: need one entry per full block"):
        block_hashes(tokens, 16, extra=[()])


def test_bad_input() -> None:
    with pytest.raises(InvalidInput, match="block_size"):
        block_hashes([1, 2], 0)
    with pytest.raises(InvalidBlockHash, match="parent"):
        block_hashes([1, 2], 2, parent=b"short")
    with pytest.raises(InvalidInput, match="token_ids"):
        block_hashes([[1, 2]], 2)


def test_key_scheme() -> None:
    scheme = KeyScheme("meta-llama/Llama-3-8B", "c22cf1da9e80e87b", rank=3, version="RL-STEP7")
    h = block_hashes(range(16), 16)[0]
    key = scheme.key(h)
    assert key == f"kv1:meta-llama/Llama-3-8B:RL-STEP7:c22cf1da9e80e87b:{h.hex()}:3"
    assert scheme.with_version("RL-STEP8").key(h) != key
    assert KeyScheme("m", "c22cf1da9e80e87b", rank=2).key(h) != KeyScheme(
        "m", "c22cf1da9e80e87b", rank=3
    ).key(h)
    for bad, field in (
        ({"namespace": "a:b"}, "namespace"),
        ({"namespace": ""}, "namespace"),
        ({"version": "v 1"}, "version"),
        ({"rank": -1}, "rank"),
    ):
        args = {"namespace": "m", "fingerprint": "c22cf1da9e80e87b", **bad}
        with pytest.raises(ConfigError, match=f"^{field}:"):
            KeyScheme(**args)
    with pytest.raises(InvalidBlockHash, match="block hash has 8 bytes, need 16..64"):
        scheme.key(h[:8])
    with pytest.raises(InvalidBlockHash, match="must be bytes"):
        scheme.key("ab" * 16)  # type: ignore[arg-type]
    # An engine's own 16-byte hashes (vLLM's xxhash) are keys as they are, never padded.
    assert (
        scheme.key(h[:16])
        == f"kv1:meta-llama/Llama-3-8B:RL-STEP7:c22cf1da9e80e87b:{h[:16].hex()}:3"
    )
    with pytest.raises(ConfigError, match="^version: must be text of at most 128"):
        scheme.with_version("RL" * 1000)


def test_keys_built_again_from_the_cache_are_the_same_and_bad_hashes_still_refused(
    monkeypatch,
) -> None:
    scheme = KeyScheme("m", "c22cf1da9e80e87b", rank=1, version="v1")
    hashes = block_hashes(range(16 * 40), 16)
    first = scheme.keys(hashes)
    assert first == [scheme.key(h) for h in hashes]
    assert scheme.keys(hashes[5:9]) == first[5:9]  # all cached now
    assert scheme.with_version("v2").keys(hashes[:1]) != first[:1]  # a version's own keys
    with pytest.raises(InvalidBlockHash, match="block hash 2 has 8 bytes"):
        scheme.keys([hashes[0], hashes[1], hashes[2][:8]])  # two cached, then a bad one
    with pytest.raises(InvalidBlockHash, match="block hash 1 must be bytes"):
        scheme.keys([hashes[0], bytearray(hashes[1])])  # type: ignore[list-item]
    # Bounded: a scheme never holds more than KEY_CACHE_ENTRIES keys, and a batch larger than
    # that is built, correct, and not kept.
    monkeypatch.setattr(keys_module, "KEY_CACHE_ENTRIES", 50)
    fresh = KeyScheme("m", "c22cf1da9e80e87b", rank=1, version="v1")
    assert fresh.keys(hashes[:30]) == first[:30]
    assert fresh.keys(hashes[30:]) == first[30:]
    assert len(fresh._cache) == 40
    assert fresh.keys(hashes[:5] + block_hashes(range(16 * 20, 16 * 35), 16)[-15:])[:5] == first[:5]
    assert len(fresh._cache) == 20  # 40 + 20 is over the bound: emptied, then these 20 kept
    assert fresh.keys(block_hashes(range(16 * 60), 16))[:40] == first  # 60: not kept at all
    assert len(fresh._cache) == 0


def test_weight_version(tmp_path, caplog) -> None:
    keys_module._warned_version_paths.clear()
    (tmp_path / "version.yaml").write_text("version: RL-STEP03-20250101-1f2e3d\n")
    assert read_weight_version(tmp_path) == "RL-STEP03"
    (tmp_path / "version.yaml").write_text("version: RL-STEP12\n")
    assert read_weight_version(tmp_path) == "RL-STEP12"
    assert read_weight_version(None) == ""
    missing = tmp_path / "nowhere"
    with caplog.at_level(logging.WARNING, logger="kvtier.layout.keys"):
        assert read_weight_version(missing) == ""
        assert read_weight_version(missing) == ""
    assert len([r for r in caplog.records if "nowhere" in r.getMessage()]) == 1  # warned once
    for text in ("version: 42\n", "other: RL-STEP1\n", "version: [unclosed\n", "RL-STEP1"):
        (tmp_path / "version.yaml").write_text(text)
        keys_module._warned_version_paths.clear()
        with caplog.at_level(logging.WARNING, logger="kvtier.layout.keys"):
            assert read_weight_version(tmp_path) == "", text
        assert "malformed" in caplog.records[-1].getMessage()


def test_hostile_version_files_neither_block_nor_flood(tmp_path, caplog) -> None:
    """A FIFO at version.yaml once blocked start and resume forever; a 370-byte YAML alias bomb
    made a 56 MiB log line. Both are now a malformed file: "" and one short warning."""
    path = tmp_path / "version.yaml"
    os.mkfifo(path)
    keys_module._warned_version_paths.clear()
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="kvtier.layout.keys"):
        assert read_weight_version(tmp_path) == ""
    assert time.monotonic() - start < 1.0
    assert "not a regular file" in caplog.records[-1].getMessage()
    path.unlink()
    bomb = ["a: &a [x, x, x, x, x, x, x, x, x]"]
    for i, name in enumerate("bcdefgh"):
        prev = "abcdefgh"[i]
        bomb.append(f"{name}: &{name} [*{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}]")
    bomb.append("version: *h")
    path.write_text("\n".join(bomb) + "\n")
    keys_module._warned_version_paths.clear()
    with caplog.at_level(logging.WARNING, logger="kvtier.layout.keys"):
        assert read_weight_version(tmp_path) == ""
    assert len(caplog.records[-1].getMessage()) < 500
    path.write_text("version: RL-STEP1-" + "x" * 10_000 + "\n")  # larger than 4 KiB: refused
    keys_module._warned_version_paths.clear()
    assert read_weight_version(tmp_path) == ""
