"""What vllm-router in front of a kvtier server costs: TTFT through the router ÷ TTFT direct.

One `vllm serve` with kvtier and one `vllm-router` (round robin) in front of it. Requests
alternate between the router and the server directly, the order flipping each time, each a new
prompt (a miss: the router's cost is beside a prefill, as in service); streamed completions,
TTFT to the first token. Needs `pip install 'kvtier[router]'`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

from kvtier_bench import serve_load as load
from kvtier_bench.common import print_json_rows, progress
from kvtier_bench.vllm_server import Router, Server


def measure(server: Server, router: Router, requests: int, prompt_tokens: int) -> dict:
    through = Server(server.model, server.workdir, port=router.port)
    ttft: dict[str, list[float]] = {"direct": [], "router": []}
    for i in range(requests):
        order = [("direct", server), ("router", through)]
        for name, target in order if i % 2 else order[::-1]:
            prompt = load._tokens(
                7919 * i + len(ttft[name]) * 104729 + (name == "router"), prompt_tokens
            )
            ttft[name].append(load.stream(target, prompt, 4, name, False).ttft_s)
    direct, routed = (statistics.median(ttft[n]) for n in ("direct", "router"))
    return {
        "measure": "TTFT p50 (s)",
        "direct": direct,
        "router": routed,
        "ratio": routed / direct,
        "goal": "<= 1.05",
        "requests": requests,
        "load_average": os.getloadavg()[0],
    }


def report(args: argparse.Namespace) -> int:
    from kvtier_bench.vllm_engine import model_or_built

    with tempfile.TemporaryDirectory(prefix="kvtier-bench-router-") as tmp:
        root = Path(tmp)
        model = model_or_built(args.model, root)
        store = {"backend": "file", "root": str(root / "store")}
        server = Server(model, root / "server", kvtier={"storage": store}).start()
        try:
            server.wait_ready()
            server.complete([5, 6, 7, 8], 2)  # warm-up
            with Router(["--worker-urls", server.url, "--policy", "round_robin"], root) as router:
                progress(f"{args.requests} requests each way")
                row = measure(server, router, args.requests, args.prompt_tokens)
        finally:
            server.stop("group")
            server.kill_marked()
    if args.json:
        print_json_rows([row])
    else:
        print(
            f"vllm-router in front of one kvtier server, {row['requests']} requests each way, "
            f"{args.prompt_tokens}-token prompts, load average {row['load_average']:.1f}\n"
            f"TTFT p50: router {row['router']:.4f} s / direct {row['direct']:.4f} s = "
            f"{row['ratio']:.3f} (goal {row['goal']})"
        )
    return 0


def main() -> int:
    from kvtier_bench.common import standalone
    from kvtier_bench.options import router_arguments

    return standalone("router", __doc__, router_arguments, report)


if __name__ == "__main__":
    raise SystemExit(main())
