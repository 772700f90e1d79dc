"""One vLLM engine in its own process: the driver `kvtier bench vllm`, `kvtier demo --engine
vllm` and the vLLM tests (``tests/vllm_engine.py``) share — ``make_model``, ``engine``,
``generate``, ``counters``, ``reset``.

``kvtier make-model DIR`` builds a random Llama with a tokenizer (no downloads; also
``python -m kvtier_bench.vllm_engine make-model DIR ...``, the same command).
``python -m kvtier_bench.vllm_engine run ARGS_JSON`` serves a prompt set several
times and prints one JSON line per run: with ``kvtier`` false, vLLM alone (its prefix cache
reset before each run, so every run recomputes); with ``kvtier`` true, each repetition serves
the prompts under a fresh weight version (a miss: computed and saved) and then again after
``reset_prefix_cache()`` (every hit comes from kvtier).
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid

from kvtier_bench.common import progress

os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")

MARK = "KVTIER-RUN "


def model_or_built(given: str | None, root: str | os.PathLike) -> str:
    """``given`` (a model directory), or a random Llama built now in ``root/model``: what the
    serving benchmarks run when no model is named."""
    if given:
        return given
    model = os.path.join(root, "model")
    progress("building a random Llama (hidden 512, 4 layers)")
    make_model(model)
    return model


def make_model(path: str, hidden: int = 512, layers: int = 4) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=8192,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # default-scale random weights give near-constant outputs
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4)
    model.save_pretrained(path)
    save_tokenizer(path, config.vocab_size)


WORD_LETTERS = "abcdefghijklmnopqrstuvwxyz012345"  # two of them name each of 1,024 token ids


def save_tokenizer(path: str, vocab_size: int) -> None:
    """A word-level tokenizer over the model's whole vocabulary (``ad``, ``ae``, ... one
    two-letter word per token id; 0-2 the usual specials), so that ``vllm serve`` takes text
    prompts and ``vllm bench serve`` can make them: decoding any ids and encoding the text gives
    the same ids. Three characters a token with its space: vLLM refuses a prompt of more than
    five characters a token of the context (before tokenizing it)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    n = len(WORD_LETTERS)
    assert vocab_size <= n * n
    special = {0: "<unk>", 1: "<s>", 2: "</s>"}
    vocab = {
        special.get(i, WORD_LETTERS[i // n] + WORD_LETTERS[i % n]): i for i in range(vocab_size)
    }
    words = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    words.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    PreTrainedTokenizerFast(
        tokenizer_object=words, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    ).save_pretrained(path)


def prompt_set(n: int, tokens: int, shared: int) -> list[list[int]]:
    """``n`` prompts of ``tokens`` tokens, the first ``shared`` common to all (a system prompt)."""
    common = [(13 * i + 7) % 1000 + 10 for i in range(shared)]
    return [
        common + [(31 * j + 97 * p) % 1000 + 10 for j in range(tokens - shared)] for p in range(n)
    ]


def engine(args: dict):
    """An offline ``LLM`` of ``args["model"]``: with the kvtier connector unless ``kvtier`` is
    false (``storage``, ``instance``, ``load_mode``, ``load_or_recompute``, ``log_dir``,
    ``kv_events``: vLLM's KV-events endpoint); ``tp`` ranks, in this
    process (``uni``, the default) or vLLM's worker processes; ``kv_bytes`` of KV cache."""
    from vllm import LLM

    kwargs: dict = dict(
        model=args["model"],
        skip_tokenizer_init=True,
        dtype="float32",
        enforce_eager=True,
        kv_cache_memory_bytes=args.get("kv_bytes", 512 << 20),
        enable_prefix_caching=True,
        max_model_len=args.get("max_model_len") or max(4096, args.get("tokens", 0) + 64),
        disable_log_stats=False,  # llm.get_metrics() needs the stats
        tensor_parallel_size=args.get("tp", 1),
    )
    if args.get("uni", True):
        kwargs["distributed_executor_backend"] = "uni"
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if args.get("kvtier", True):
        extra = {
            "storage": args["storage"],
            "instance_id": args["instance"],
            "load_mode": args.get("load_mode", "auto"),
            "load_or_recompute": args.get("load_or_recompute", True),
        }
        if args.get("log_dir"):
            extra["log_dir"] = args["log_dir"]
        if args.get("kv_events"):  # vLLM's publisher, which carries kvtier's tier events too
            kwargs["kv_events_config"] = {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": args["kv_events"],
            }
        kwargs["kv_transfer_config"] = {
            "kv_connector": "KvtierConnector",
            "kv_connector_module_path": "kvtier.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        }
    return LLM(**kwargs)


def counters(llm) -> dict:
    """vLLM's external-hit counters and kvtier's connector counters, by name (one per tier:
    ``kvtier_tier_loaded_tokens[N]``)."""
    out = {}
    for m in llm.get_metrics():
        if m.name.startswith(("vllm:kvtier_", "vllm:external_prefix")):
            tier = getattr(m, "labels", {}).get("tier")
            name = m.name.split(":", 1)[1] + (f"[{tier}]" if tier is not None else "")
            out[name] = getattr(m, "value", 0)
    return out


def reset(llm) -> None:
    """Drop vLLM's own prefix cache, so the next hits can only come from kvtier."""
    for _ in range(200):
        if llm.reset_prefix_cache():
            return
        llm.llm_engine.step()  # blocks still held by transfers: an idle step releases them
        time.sleep(0.02)
    raise RuntimeError("reset_prefix_cache kept failing")


def generate(llm, prompts: list[list[int]], max_tokens: int = 1) -> dict:
    """Greedy completions of token-id prompts: tokens, cached tokens, wall time, and how
    every counter moved."""
    from vllm.inputs import TokensPrompt

    from vllm import SamplingParams

    before = counters(llm)
    start = time.perf_counter()
    outputs = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in prompts],
        SamplingParams(max_tokens=max_tokens, temperature=0),
        use_tqdm=False,
    )
    wall = time.perf_counter() - start
    after = counters(llm)
    return {
        "tokens": [list(o.outputs[0].token_ids) for o in outputs],
        "cached": [o.num_cached_tokens for o in outputs],
        "wall_s": wall,
        "delta": {k: after.get(k, 0) - before.get(k, 0) for k in after},
    }


def _serve(llm, prompts: list[list[int]], label: str, rep: int) -> None:
    out = generate(llm, prompts)
    delta = out.pop("delta")
    record = {"configuration": label, "rep": rep, **out, **delta}
    print(MARK + json.dumps(record), flush=True)


def run(args: dict) -> None:
    prompts = prompt_set(args["prompts"], args["tokens"], args.get("shared", 0))
    llm = engine(args)
    client = None
    if args["kvtier"]:
        from kvtier.engine.client import Client
        from kvtier.worker.config import endpoint_for

        client = Client.connect([endpoint_for(args["instance"], 0)], start_timeout_s=120)
    for rep in range(args["reps"]):
        reset(llm)
        if client is None:
            _serve(llm, prompts, "vLLM alone (recompute)", rep)
            continue
        version = f"RL-STEP{rep}-{uuid.uuid4().hex[:6]}"
        assert client.control("update_weights", version=version).code == 200  # all misses
        _serve(llm, prompts, "vLLM + kvtier, first run (miss + save)", rep)
        reset(llm)  # waits for the saves: their blocks are held until they are done
        _serve(llm, prompts, "vLLM + kvtier, after reset_prefix_cache (hits)", rep)
    if client is not None:
        client.close()
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    if sys.argv[1:2] != ["run"]:  # make-model, --help, ...: kvtier's own command line
        from kvtier.ops.cli import run as kvtier

        sys.argv = ["kvtier", *sys.argv[1:]]
        kvtier()
    else:
        run(json.loads(sys.argv[2]))
    sys.stdout.flush()
    os._exit(0)  # vLLM's interpreter teardown is slow; the engine was shut down above
