#!/usr/bin/env bash
# The CUDA check of kvtier, in one call on the device machine (issue 19).
#
#   bash bench/device_check.sh --fetch-wheels   # here, once: the wheels the device image lacks
#   bash bench/device_check.sh                  # there: install, build, pytest -m gpu, benchmarks
#   bash bench/device_check.sh --dry-run        # anywhere: every step it would run, CPU-side
#
# On the device (no registry reachable) it installs the carried wheels (.whl/: pyzmq, msgspec,
# blake3 for CPython 3.12), builds kvtier's C extension, runs the GPU tests and the GPU
# benchmarks, and writes every figure as JSON under $OUT (the device tool brings $OUT back):
#   environment.json  gpu-tests.txt  gpu-tests.xml  bench-copy.json  summary.json
# It is sized to end well inside one 10-minute call, so that a second call can rerun it after
# a fix. --dry-run runs the CPU-side steps (collection, a small CPU benchmark) and prints the
# rest; it needs no GPU and no carried wheels.
set -uo pipefail
cd "$(dirname "$0")/.."

MODE=device
case "${1:-}" in
    --dry-run) MODE=dry ;;
    --fetch-wheels) MODE=fetch ;;
    "") ;;
    *) echo "usage: bash bench/device_check.sh [--dry-run|--fetch-wheels]" >&2; exit 2 ;;
esac
OUT=${OUT:-$(mktemp -d /tmp/kvtier-device-check-XXXXXX)}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
WHEELS=(pyzmq==27.3.0 msgspec==0.23.0 blake3==1.0.11)
STATUS=0
step() { echo "== $*" >&2; }

if [[ $MODE == fetch ]]; then
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
    platforms=()
    for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
        platforms+=(--platform "$p")
    done
    exec "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp "${platforms[@]}" -d .whl "${WHEELS[@]}"
fi

step "environment"
"$PY" - > "$OUT/environment.json" <<'EOF'
import json, platform, subprocess
import torch
info = {"python": platform.python_version(), "torch": torch.__version__,
        "cuda_available": torch.cuda.is_available()}
if torch.cuda.is_available():
    info["device"] = torch.cuda.get_device_name(0)
    info["cuda"] = torch.version.cuda
try:
    info["nvidia_smi"] = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True,
                                        timeout=20).stdout.strip()
except (OSError, subprocess.TimeoutExpired):
    info["nvidia_smi"] = None
print(json.dumps(info))
EOF
cat "$OUT/environment.json" >&2

if [[ $MODE == device ]]; then
    step "carried wheels"
    if ls .whl/*.whl >/dev/null 2>&1; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site .whl/*.whl || exit 3
        export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    else
        echo "no .whl/ here: run 'bash bench/device_check.sh --fetch-wheels' before the call" >&2
    fi
    step "build and install kvtier (no dependencies: the image has torch)"
    "$PY" -m pip install -q --no-deps --no-build-isolation --no-index -e . || exit 4
    "$PY" -c "import kvtier._copy" 2>/dev/null && echo "C copier built" >&2 \
        || echo "C copier NOT built: the torch copier is used" >&2
fi

GPU_TESTS=(tests/engine/test_gpu.py tests/unit/test_copier.py tests/unit/test_device.py)
step "pytest -m gpu"
if [[ $MODE == dry ]]; then
    "$PY" -m pytest -q -p no:cacheprovider -m gpu "${GPU_TESTS[@]}" -rs \
        > "$OUT/gpu-tests.txt" 2>&1
else
    timeout 300 "$PY" -m pytest -q -p no:cacheprovider -m gpu "${GPU_TESTS[@]}" -rs -x \
        --junitxml="$OUT/gpu-tests.xml" > "$OUT/gpu-tests.txt" 2>&1
fi
tests_rc=$?
tail -5 "$OUT/gpu-tests.txt" >&2
[[ $tests_rc -ne 0 ]] && STATUS=1

step "kvtier bench copy"
if [[ $MODE == dry ]]; then
    bench=(--device cpu --block-sizes 16 --num-blocks 16,64 --runs 2 --storage --json)
else  # N = 16 ... 4096 blocks of 64 and 1024 KiB: swaps beside pinned copies, loads from storage
    bench=(--device cuda --block-sizes 16,256 --num-blocks 16,256,1024,4096 --runs 3 --storage --json)
fi
timeout 300 "$PY" -m kvtier.ops.cli bench copy "${bench[@]}" > "$OUT/bench-copy.json" 2> "$OUT/bench-copy.log"
bench_rc=$?
tail -3 "$OUT/bench-copy.log" >&2
[[ $bench_rc -ne 0 ]] && STATUS=1

"$PY" - "$OUT" "$MODE" "$tests_rc" "$bench_rc" > "$OUT/summary.json" <<'EOF'
import json, sys
out, mode, tests_rc, bench_rc = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
lines = open(f"{out}/gpu-tests.txt").read().strip().splitlines()
rows = [json.loads(l) for l in open(f"{out}/bench-copy.json") if l.startswith("{")]
print(json.dumps({
    "mode": mode,
    "pytest_rc": tests_rc,
    "pytest": lines[-1] if lines else "",
    "bench_rc": bench_rc,
    "bench": [{k: r.get(k) for k in ("block_size", "num_blocks", "direction", "gbps",
               "limit_gbps", "ratio_to_limit", "speedup_vs_loop")} for r in rows],
}, indent=1))
EOF
cat "$OUT/summary.json"
echo "figures in $OUT" >&2
exit $STATUS
