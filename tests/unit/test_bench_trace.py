"""``kvtier bench trace``'s reading of a trace and its ideal hits, without a server: it reads only
the trace it is given — a regular file, line by line, bounded — and says what is wrong with one."""

from __future__ import annotations

import argparse
import gzip
import json
import os

import pytest

from kvtier.errors import ConfigError
from kvtier_bench.options import trace_arguments
from kvtier_bench.trace import MAX_LINE_BYTES, ideal_hits, read_trace, requests_of


def _line(t: int, ids: list[int], out: int = 4) -> bytes:
    entry = {"timestamp": t, "input_length": 512 * len(ids), "output_length": out, "hash_ids": ids}
    return json.dumps(entry).encode() + b"\n"


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    trace_arguments(parser)
    return parser.parse_args(["--block-tokens", "4", "--max-prompt-tokens", "12", *argv])


def test_a_trace_becomes_requests_with_the_same_tokens_for_the_same_hash_ids(tmp_path) -> None:
    path = tmp_path / "t.jsonl.gz"
    lines = [_line(0, [0, 1, 2, 3]), _line(500, [1, 9]), _line(1000, [0, 1, 5]), _line(1500, [2])]
    path.write_bytes(gzip.compress(b"".join(lines)))
    kept = read_trace(str(path), 0, 10, every=1)
    assert [k["hash_ids"][0] for k in kept] == [0, 1, 0, 2]
    assert [k["hash_ids"][0] for k in read_trace(str(path), 0, 10, every=2)] == [0, 0, 2]
    assert len(read_trace(str(path), 1, 2)) == 2  # the window: lines 1 and 2
    requests = requests_of(kept, _args("--time-scale", "2"))
    assert [r.at_s for r in requests] == [0.0, 1.0, 2.0, 3.0]
    assert len(requests[0].prompt) == 12  # 3 blocks of 4 tokens: the prompt cap
    assert requests[2].prompt[:8] == requests[0].prompt[:8]  # blocks 0, 1: the same tokens
    assert requests[2].prompt[8:] != requests[0].prompt[8:]
    # Leading blocks seen before, each known by its whole prefix (as chained block hashes):
    # #2 reuses [0], [0, 1] (8 tokens); #1's [1] and #3's [2] follow no earlier prefix.
    assert ideal_hits(requests, 4, None) == 8
    assert ideal_hits(requests, 4, 2) == 0  # an LRU of two blocks: [0] and [0, 1] were evicted


def test_what_is_not_a_trace_is_refused_without_reading_anything_else(tmp_path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match="not a regular file"):
        read_trace(str(fifo), 0, 10)  # never blocks waiting for a writer
    with pytest.raises(ConfigError, match="cannot open"):
        read_trace(str(tmp_path / "missing"), 0, 10)
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(_line(0, [1]) + b"not json\n")
    with pytest.raises(ConfigError, match=r"bad.jsonl:2: not JSON"):
        read_trace(str(bad), 0, 10)
    bad.write_bytes(_line(0, [1]) + b'{"timestamp": 1, "hash_ids": ["x"], "output_length": 1}\n')
    with pytest.raises(ConfigError, match=r":2: not a trace line"):
        read_trace(str(bad), 0, 10)
    huge = tmp_path / "huge.jsonl"
    huge.write_bytes(b"[" + b"1," * MAX_LINE_BYTES + b"1]\n")
    with pytest.raises(ConfigError, match="a line over"):
        read_trace(str(huge), 0, 10)


def test_a_deeply_nested_line_and_a_gzip_bomb_are_one_line_errors(tmp_path, monkeypatch) -> None:
    """Round 5: a deeply nested line ended ``kvtier bench trace`` with RecursionError, and a
    small gzip bomb kept it reading for minutes."""
    import kvtier_bench.trace as trace

    nested = tmp_path / "nested.jsonl"
    nested.write_bytes(b"[" * 200_000 + b"]" * 200_000 + b"\n")
    with pytest.raises(ConfigError, match="nested deeper"):
        read_trace(str(nested), 0, 10)
    line = b'{"timestamp": 0, "output_length": 1, "hash_ids": [1, 2]}\n'
    bomb = tmp_path / "bomb.jsonl.gz"
    with gzip.open(bomb, "wb") as f:
        for _ in range(1000):
            f.write(line * 1000)  # 58 MB of lines, about 100 kB compressed
    assert bomb.stat().st_size < 1 << 20
    monkeypatch.setattr(trace, "MAX_TRACE_BYTES", 1 << 20)  # the bound, scaled down
    with pytest.raises(ConfigError, match="over 1048576 bytes before line"):
        read_trace(str(bomb), 10**9, 10)
