"""The built wheel is a product on its own: installed into a fresh virtual environment outside the
checkout, it exposes the single import name ``pdserve`` (nothing generic such as ``model`` or
``proto``), carries the embedded model and the ``.proto`` contracts, and ``pdserve demo`` serves
from an unrelated directory.

The fresh environment gets the wheel alone (``--no-deps``); its dependencies (torch, ray, grpcio,
...: several GB) are made visible by a ``.pth`` line naming the project venv's site-packages. Python
does not run the ``.pth`` files of a directory added that way, so the project's editable install
(its import hook onto the checkout) stays out of the fresh environment.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

from pdserve.deploy.cli import DEMO_PROMPTS

ROOT = Path(__file__).resolve().parent.parent
GENERIC = ("model", "router", "proto", "deploy", "kernels", "bench", "cluster", "kvtransfer",
           "prefill_worker", "decode_worker", "assets")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out),
                    str(ROOT)], check=True, capture_output=True, text=True, cwd=out)
    (found,) = out.glob("pdserve-*.whl")
    return found


@pytest.fixture(scope="module")
def fresh_env(wheel, tmp_path_factory) -> Path:
    """A new virtual environment (outside the checkout) with only the wheel installed into it."""
    env_dir = tmp_path_factory.mktemp("venv") / "env"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", str(wheel)],
                   check=True, capture_output=True, text=True)
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    (site / "_pdserve_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return env_dir


def run_in(env_dir: Path, args: list[str], cwd: Path, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{env_dir / 'bin'}:{env['PATH']}"
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_wheel_carries_the_model_and_the_contracts_under_one_name(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"pdserve"}, tops
    for required in ("pdserve/proto/pdserve.proto", "pdserve/proto/worker.proto",
                     "pdserve/assets/models/tinystories-656k/model.safetensors",
                     "pdserve/assets/models/tinystories-656k/tokenizer.json",
                     "pdserve/kernels/cpu/gemv_bf16.c", "pdserve/kernels/cpu/bf16.h",
                     "pdserve/bench/replay/corpus.txt"):
        assert required in names, required
    entry_points = zipfile.ZipFile(wheel).read(f"{wheel.name.split('-py3')[0]}.dist-info/entry_points.txt").decode()
    assert "pdserve = pdserve.deploy.cli:main" in entry_points and "bench = pdserve.bench.replay.cli" in entry_points


def test_installed_wheel_imports_only_pdserve(fresh_env, tmp_path):
    probe = ("import importlib.util, json, pdserve.router.server, pdserve.deploy.cli, pdserve.proto as p\n"
             "from pdserve.deploy.config import EMBEDDED_MODEL\n"
             f"print(json.dumps({{'generic': [m for m in {GENERIC!r} if importlib.util.find_spec(m)],"
             " 'proto': p.__path__[0], 'model': EMBEDDED_MODEL}))")
    proc = run_in(fresh_env, [str(fresh_env / "bin" / "python"), "-c", probe], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout)
    assert seen["generic"] == [], f"generic top-level modules importable: {seen['generic']}"
    assert str(fresh_env) in seen["proto"] and str(ROOT) not in seen["proto"]  # the wheel's copy, not the checkout
    assert Path(seen["model"], "model.safetensors").exists() and str(fresh_env) in seen["model"]
    help_text = run_in(fresh_env, [str(fresh_env / "bin" / "pdserve"), "--help"], cwd=tmp_path)
    assert help_text.returncode == 0 and "bench" in help_text.stdout and "make-model" in help_text.stdout


def test_installed_wheel_serves_the_demo(fresh_env, tmp_path):
    """``pdserve demo`` from an unrelated directory: Ray, a router, a prefill and a decode worker from
    the installed files, six completions printed."""
    proc = run_in(fresh_env, [str(fresh_env / "bin" / "pdserve"), "demo", "--max-tokens", "8"], cwd=tmp_path,
                  timeout=280)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "router listening on 127.0.0.1:" in proc.stdout
    assert proc.stdout.count("8 tokens, finish FINISH_REASON_LENGTH") == len(DEMO_PROMPTS), proc.stdout[-3000:]
