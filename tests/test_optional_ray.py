"""Ray is an optional extra (hpsft[ray]): the SPMD path never imports it, and the Ray entry
point without it says what to install."""

import subprocess
import sys

from tests.conftest import REPO, base_overrides, read_metrics, train_env
from tests.test_spmd_training import assert_ok

# Runs an entry point's main() in this interpreter, then reports whether ray got imported.
# sys.modules["ray"] = None makes `import ray` fail as if Ray were not installed.
RUN_MAIN = """
import sys
if sys.argv[1] == "without-ray":
    sys.modules["ray"] = None
import importlib
rc = importlib.import_module(sys.argv[2]).main(sys.argv[3:])
print("ray imported:", sys.modules.get("ray") is not None)
sys.exit(rc)
"""


def run_main(module: str, args: list[str], without_ray: bool):
    return subprocess.run(
        [sys.executable, "-c", RUN_MAIN, "without-ray" if without_ray else "with-ray", module, *args],
        cwd=REPO, env=train_env(), capture_output=True, text=True, timeout=600,
    )


def test_spmd_training_never_imports_ray(tmp_path, model_path, tiny_data):
    """A whole single-process run (build, a step, validation, checkpoint, export)."""
    train, val = tiny_data
    out = tmp_path / "run"
    proc = run_main("hpsft.train", base_overrides(model_path, train, val, out, **{"trainer.total_steps": 1}),
                    without_ray=False)
    assert_ok(proc)
    assert "ray imported: False" in proc.stdout
    assert "hpsft: launcher none: world size 1, 1 node(s), 1 rank(s) per node" in proc.stdout
    assert [m["step"] for m in read_metrics(out)] == [1]


def test_ray_entry_point_without_ray_says_what_to_install(tmp_path):
    proc = run_main("hpsft.train_ray", [f"trainer.output_dir={tmp_path / 'run'}"], without_ray=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "hpsft: error: python -m hpsft.train_ray needs Ray, which is not installed: pip install 'hpsft[ray]' "
        "(or train without Ray: python -m hpsft.train)"]
    assert not (tmp_path / "run").exists()
