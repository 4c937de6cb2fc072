"""The main job (`python -m needle_hf.demo`, what ./run.sh runs) finds its checkpoint and tokenizer
inside the package, wherever it is started from: the data ships in the wheel, not in scripts/."""

import os
import subprocess
import sys

import needle_hf.demo


def test_demo_data_lives_in_the_package():
    for name in ("needle2-demo.pkl", "tokenizer.model", "train_demo_results.json"):
        assert (needle_hf.demo.DEMO_DIR / name).is_file(), name
    assert needle_hf.demo.DEMO_DIR.parent.name == "needle_hf"


def test_main_job_runs_from_outside_the_repository_and_calls_the_tool(tmp_path):
    out = tmp_path / "needle2-hf"
    run = subprocess.run([sys.executable, "-m", "needle_hf.demo", "--out", str(out)], cwd=tmp_path,
                         capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    assert "using the shipped demo checkpoint" in run.stdout
    assert '"name": "set_alarm"' in run.stdout, run.stdout[-2000:]
    assert (out / "config.json").is_file()
