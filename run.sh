#!/usr/bin/env bash
# Sets everything up (.venv, .venv-v5) and runs the main job: convert a Needle 2 checkpoint (the
# shipped demo one, or the path given) into a Hugging Face folder, load it with
# FlaxAutoModelForCausalLM, and generate from a tool-calling prompt.
#   ./run.sh [CHECKPOINT.pkl|.cact] [--tokenizer tokenizer.model] [--out DIR]
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/setup.sh
exec .venv/bin/python -m needle_hf.demo "$@"
