#!/usr/bin/env bash
# Sets everything up (.venv, .venv-v5, .venv-vllm, .venv-n3) and runs the whole test suite:
#   1. every test under transformers 4.57 (Flax + PyTorch + conversion + Hub) in .venv, on two pytest workers;
#   2. the suites marked `v5` (PyTorch model, pipeline, tokenizer, fine-tuning, decoding, README) again under
#      the newest transformers 5.x in .venv-v5;
#   3. the suites marked `vllm` (tests/serving/vllm: generation parity, tool calling through the server) in .venv-vllm.
#   4. the Needle 3 suite (tests/needle3: parity with cactus-needle 3.2.8, conversion, docs/needle3.md) in .venv-n3
#      (suite 1 leaves tests/needle3 out: .venv's reference is Needle 2's).
# Suites 2, 3 and 4 run one after the other beside suite 1; their output is printed when they end.
# Extra arguments go to every pytest run (e.g. ./test.sh -x -k parity).
set -uo pipefail
cd "$(dirname "$0")"
bash scripts/setup.sh || exit 1

suite_v5() {
    echo "=== transformers 5.x (.venv-v5): PyTorch model and tokenizer suites ==="
    # needle-hf is not installed in .venv-v5 (the remote-code tests need an environment without it);
    # the suite imports it from the source tree.
    PYTHONPATH="$PWD" .venv-v5/bin/python -m pytest tests -m v5 --ignore=tests/serving/vllm "$@"
}

suite_vllm() {
    echo "=== vLLM (.venv-vllm): tests/serving/vllm ==="
    .venv-vllm/bin/python -m pytest tests/serving/vllm -m vllm "$@"
}

suite_n3() {
    echo "=== Needle 3 (.venv-n3): tests/needle3 ==="
    OMP_NUM_THREADS=1 .venv-n3/bin/python -m pytest tests/needle3 "$@"
}

LOGS=$(mktemp -d)
(
    suite_v5 "$@" >"$LOGS/v5.log" 2>&1; echo $? >"$LOGS/v5.rc"
    suite_vllm "$@" >"$LOGS/vllm.log" 2>&1; echo $? >"$LOGS/vllm.rc"
    suite_n3 "$@" >"$LOGS/n3.log" 2>&1; echo $? >"$LOGS/n3.rc"
) &
others=$!
trap 'kill $others 2>/dev/null; rm -rf "$LOGS"' EXIT

status=0
echo "=== transformers 4.57 (.venv): whole suite, two workers ==="
# One pytest process keeps ~1.2 of the 2 cores busy (JAX compiles are single-threaded, the torch tests
# run on one thread): two workers, whole files to each (module fixtures are built once), fill the rest.
.venv/bin/python -m pytest tests -m "not vllm" --ignore=tests/serving/vllm -n 2 --dist loadfile --durations=25 "$@" || status=1

wait $others
for suite in v5 vllm n3; do
    cat "$LOGS/$suite.log"
    [ "$(cat "$LOGS/$suite.rc")" = 0 ] || status=1
done
exit $status
