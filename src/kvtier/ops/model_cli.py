"""``kvtier make-model DIR``: a small random Llama with a tokenizer, for trying kvtier under
``vllm serve`` on a machine that cannot download a model (docs/vllm.md's quick start).

Built offline in seconds: random weights (scaled so that greedy outputs vary), a vocabulary of
1,024 two-letter words (``aa`` ... ``55``; text prompts work, and ``vllm bench serve`` can make
them), saved as a Hugging Face model directory. Its answers are nonsense; its KV cache is real.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
from typing import Any

from kvtier.errors import ConfigError
from kvtier.ops.cli_args import DefaultsFormatter, integer

HEAD_DIM = 64


def add_make_model(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "make-model",
        parents=[common],
        help="build a small random Llama with a tokenizer (offline) to try vllm serve with",
        description=__doc__,
        formatter_class=DefaultsFormatter,
    )
    p.add_argument("directory", help="where to write it: a new or empty directory")
    p.add_argument(
        "--hidden",
        type=integer(4 * HEAD_DIM, 8192),
        default=512,
        help=f"hidden size, a multiple of {4 * HEAD_DIM} (heads of {HEAD_DIM}, 4 key-value)",
    )
    p.add_argument("--layers", type=integer(1, 64), default=4, help="decoder layers")
    p.set_defaults(func=_make_model)


def _make_model(args: argparse.Namespace) -> int:
    if args.hidden % HEAD_DIM or (args.hidden // HEAD_DIM) % 4:
        raise ConfigError(
            "hidden", f"must be a multiple of {4 * HEAD_DIM} (4 key-value heads of {HEAD_DIM})"
        )
    target = os.path.abspath(args.directory)
    if os.path.exists(target) and (not os.path.isdir(target) or os.listdir(target)):
        raise ConfigError("directory", f"{target} exists and is not empty: give a new directory")
    needed = ("transformers", "tokenizers", "kvtier_bench")
    missing = [m for m in needed if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError(
            "make-model",
            f"needs {' and '.join(missing)} (transformers and tokenizers come with vLLM, "
            "kvtier_bench with kvtier: see the README's vLLM section)",
        )
    # local: the benchmarks' model builder (and transformers) load only for this command
    from kvtier_bench.vllm_engine import make_model

    make_model(target, args.hidden, args.layers)
    print(
        f"a random Llama (hidden {args.hidden}, {args.layers} layers, 1,024 two-letter words) "
        f"and its tokenizer in {target}\n"
        f"next: python -m kvtier.vllm serve {target} ... (docs/vllm.md, quick start)"
    )
    return 0
