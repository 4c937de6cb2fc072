"""Beyond one process: DDP fine-tuning under `accelerate launch`, and the Flax model on a device mesh.

- `accelerate launch --multi_gpu --num_processes 2` on a machine without GPUs runs two CPU processes
  joined by gloo (torch.distributed.run, `TrainingArguments(use_cpu=True)`). `NeedleTrainer` there,
  with the per-device batch halved, must give the loss curve and the trained adapter of one process
  with the whole batch (tests/support/distributed_finetune_worker.py is the run).
- The Flax model jit-compiled over a 2-device CPU mesh (`XLA_FLAGS=--xla_force_host_platform_device_count=2`,
  set in a child interpreter before jax starts), the batch sharded over the mesh's "data" axis and
  the parameters replicated, gives the logits of one device.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import transformers

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "support" / "distributed_finetune_worker.py"
HAS_FLAX = hasattr(transformers, "FlaxAutoModelForCausalLM")

pytestmark = pytest.mark.v5  # also runs under transformers 5.x (.venv-v5)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run(command, out: Path, *, env_extra: dict) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", **env_extra}
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert result.returncode == 0, (result.stdout[-2000:], result.stderr[-4000:])
    return json.loads(out.read_text())


def test_ddp_over_two_cpu_processes_gives_the_single_process_loss_curve(tmp_path):
    accelerate = shutil.which("accelerate", path=str(Path(sys.executable).parent))
    assert accelerate, "accelerate (the finetune extra) is not installed in this environment"
    one = _run([sys.executable, str(WORKER), str(tmp_path / "one.json"), "--per-device-batch", "8"],
               tmp_path / "one.json", env_extra={})
    two = _run([accelerate, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
                "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(_free_port()),
                str(WORKER), str(tmp_path / "two.json"), "--per-device-batch", "4"],
               tmp_path / "two.json", env_extra={})
    assert (one["world_size"], two["world_size"]) == (1, 2)
    assert len(one["losses"]) == len(two["losses"]) == 6
    # Trainer logs losses rounded to 4 decimals; the adapters are compared in full.
    np.testing.assert_allclose(two["losses"], one["losses"], rtol=0, atol=2e-4)
    assert one["losses"][-1] < one["losses"][0]  # it trains
    assert one["adapter"].keys() == two["adapter"].keys() and one["adapter"]
    for name in one["adapter"]:
        np.testing.assert_allclose(np.asarray(two["adapter"][name]), np.asarray(one["adapter"][name]),
                                   rtol=0, atol=5e-5, err_msg=name)


_MESH_CHILD = textwrap.dedent("""
    import json, sys
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
    sys.path.insert(0, sys.argv[1])
    from flax_support import random_tokens
    from needle_reference import TINY_NATIVE_CONFIG
    from needle_hf.models.needle.configuration_needle import NeedleConfig
    from needle_hf.models.needle.modeling_flax_needle import FlaxNeedleForCausalLM

    assert len(jax.devices()) == 2, jax.devices()
    config = NeedleConfig.from_needle_config(dict(TINY_NATIVE_CONFIG))
    model = FlaxNeedleForCausalLM(config, seed=0)
    # Random init leaves norms and gates at zero/one: perturb every leaf.
    leaves, tree = jax.tree_util.tree_flatten(model.params)
    keys = jax.random.split(jax.random.PRNGKey(1), len(leaves))
    params = jax.tree_util.tree_unflatten(
        tree, [leaf + 0.05 * jax.random.normal(key, leaf.shape, leaf.dtype) for leaf, key in zip(leaves, keys)])
    ids = random_tokens(0, 4, 24, config.vocab_size)
    mask = np.ones_like(ids)
    mask[1, :5] = 0

    forward = jax.jit(lambda p, i, m: model(i, attention_mask=m, params=p).logits)
    one_device = np.asarray(forward(jax.device_put(params, jax.devices()[0]), ids, mask))

    mesh = Mesh(np.array(jax.devices()), ("data",))
    batch = NamedSharding(mesh, PartitionSpec("data"))         # [B, T]: rows split over the devices
    replicated = NamedSharding(mesh, PartitionSpec())
    sharded_logits = forward(jax.device_put(params, replicated), jax.device_put(ids, batch), jax.device_put(mask, batch))
    print(json.dumps({
        "devices": len(sharded_logits.sharding.device_set),
        "max_abs_diff": float(np.abs(np.asarray(sharded_logits) - one_device).max()),
        "scale": float(np.abs(one_device).max()),
    }))
""")


@pytest.mark.skipif(not HAS_FLAX, reason="the Flax model needs transformers 4.x (5.x has no Flax)")
def test_flax_model_on_a_two_device_cpu_mesh_equals_one_device():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
    result = subprocess.run([sys.executable, "-c", _MESH_CHILD, str(REPO / "tests" / "support")], env=env, capture_output=True,
                            text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.splitlines()[-1])
    assert report["devices"] == 2
    assert report["scale"] > 0.1 and report["max_abs_diff"] <= 1e-5, report
