"""llama.cpp as a peer: build it from the pinned ``llama-cpp-python`` sdist, convert checkpoints to GGUF.

The sdist vendors llama.cpp (``vendor/llama.cpp``, a shallow git checkout whose commit we record).
We build only ``llama-bench``, ``llama-quantize`` and ``llama-perplexity``, with the ISA options
chosen explicitly from ``/proc/cpuinfo`` (``GGML_NATIVE=OFF``: a ``-march=native`` build of the
quantized paths crashed on one of this project's VMs), without CURL/OpenSSL and without OpenMP
(ggml's own thread pool; ``-t 1`` then really is one thread). The build is cached under
``~/.cache/pdserve/peers/<version>-<hash of flags>``; a second run reuses it.

Checkpoints go through llama.cpp's own ``convert_hf_to_gguf.py`` (the vendored ``gguf-py`` on
``PYTHONPATH``) to bf16/f32 GGUF and through ``llama-quantize`` to Q4_0 / Q4_K_M.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

VERSION = "0.3.36"
SDIST = f"llama_cpp_python-{VERSION}.tar.gz"
SENTENCEPIECE = "0.2.3"                   # what llama.cpp's converter imports (pinned like the peer itself)
CACHE = Path.home() / ".cache" / "pdserve" / "peers"
TARGETS = ("llama-bench", "llama-quantize", "llama-perplexity")
# /proc/cpuinfo flag -> ggml CMake option (the AMX ones only exist where the kernel exposes AMX)
ISA_OPTIONS = {"sse4_2": "GGML_SSE42", "avx": "GGML_AVX", "avx2": "GGML_AVX2", "bmi2": "GGML_BMI2",
               "fma": "GGML_FMA", "f16c": "GGML_F16C", "avx_vnni": "GGML_AVX_VNNI", "avx512f": "GGML_AVX512",
               "avx512vbmi": "GGML_AVX512_VBMI", "avx512_vnni": "GGML_AVX512_VNNI",
               "avx512_bf16": "GGML_AVX512_BF16", "amx_tile": "GGML_AMX_TILE", "amx_int8": "GGML_AMX_INT8",
               "amx_bf16": "GGML_AMX_BF16"}
REPORTED_FLAGS = ("amx_tile", "amx_bf16", "amx_int8", "avx512_bf16", "avx512_vnni", "avx512f", "avx2")


def cpu_flags() -> set[str]:
    """The ``flags`` of the first processor in ``/proc/cpuinfo`` (empty set where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_model() -> str:
    """``lscpu``'s "Model name" (or ``/proc/cpuinfo``'s ``model name``; "unknown")."""
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines():
            if line.strip().startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return "unknown"


def cmake_flags(flags: set[str]) -> list[str]:
    """CMake ``-D`` options: every ISA option ON exactly where its cpuinfo flag is present."""
    isa = [f"-D{opt}={'ON' if flag in flags else 'OFF'}" for flag, opt in ISA_OPTIONS.items()]
    return ["-DGGML_NATIVE=OFF", "-DGGML_OPENMP=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
            "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
            "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_TOOLS=ON", "-DCMAKE_BUILD_TYPE=Release", *isa]


def fetch_sdist(work: Path) -> Path:
    """The pinned sdist in ``work`` (the peers cache), downloaded there with ``pip download`` once.

    Raises:
        subprocess.CalledProcessError: pip could not fetch it.
    """
    if (work / SDIST).exists():
        return work / SDIST
    work.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                    f"llama-cpp-python=={VERSION}", "-d", str(work)], check=True)
    return work / SDIST


def _git(src: Path, *args: str) -> str:
    try:
        return subprocess.run(["git", "-C", str(src), *args], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def build(jobs: int = 2, log=print) -> dict:
    """Build (or reuse) llama.cpp's tools; returns ``{"bin": dir, "src": vendored tree, "commit", "flags", ...}``.

    Raises:
        subprocess.CalledProcessError: cmake configure or build failed (its log is in the build dir).
    """
    flags = cmake_flags(cpu_flags())
    key = hashlib.sha256(" ".join(flags).encode()).hexdigest()[:12]
    root = CACHE / f"{VERSION}-{key}"
    info_path = root / "build-info.json"
    if info_path.exists():
        info = json.loads(info_path.read_text())
        if all((Path(info["bin"]) / t).exists() for t in TARGETS):
            log(f"llama.cpp: reusing build {root}")
            return info
    root.mkdir(parents=True, exist_ok=True)
    sdist = fetch_sdist(root)
    src_parent = root / "src"
    if not (src_parent / f"llama_cpp_python-{VERSION}").exists():
        with tarfile.open(sdist) as tar:
            tar.extractall(src_parent, filter="fully_trusted")
    src = src_parent / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"
    bdir = root / "build"
    log(f"llama.cpp: building {', '.join(TARGETS)} in {bdir} (takes a while)")
    env = dict(os.environ)
    with open(root / "build.log", "w") as out:
        subprocess.run(["cmake", "-S", str(src), "-B", str(bdir), "-G", "Ninja", *flags], check=True,
                       stdout=out, stderr=subprocess.STDOUT, env=env)
        subprocess.run(["nice", "cmake", "--build", str(bdir), "-j", str(jobs), "--target", *TARGETS],
                       check=True, stdout=out, stderr=subprocess.STDOUT, env=env)
    info = {"version": f"llama-cpp-python {VERSION}", "commit": _git(src, "rev-parse", "HEAD"),
            "build_number_in_sdist": _git(src, "rev-list", "--count", "HEAD"), "cmake_flags": flags,
            "compiler": subprocess.run(["cc", "--version"], capture_output=True, text=True).stdout.split("\n")[0],
            "bin": str(bdir / "bin"), "src": str(src)}
    info_path.write_text(json.dumps(info, indent=2))
    return info


def converter_deps() -> Path:
    """A folder outside the venv holding what the converter imports and the venv lacks: ``sentencepiece``
    (imported unconditionally by its Llama vocabulary path even when there is no ``tokenizer.model``).

    Raises:
        subprocess.CalledProcessError: pip could not install it.
    """
    deps = CACHE / f"pydeps-sentencepiece-{SENTENCEPIECE}"
    if not (deps / "sentencepiece").exists():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--target", str(deps),
                        f"sentencepiece=={SENTENCEPIECE}"], check=True)
    return deps


# convert_hf_to_gguf.py run with one fallback: a BPE tokenizer whose pre-tokenizer llama.cpp does not know by its
# hash (the bench checkpoints' embedded tokenizer in a Qwen-family config: the Qwen converters read the vocabulary
# as GPT-2 BPE and look the pre-tokenizer up) is written as llama.cpp's "default" one instead of refused. It only
# decides how llama.cpp would split text; llama-bench times token ids, and the perplexity runs use the Llama
# converter's path, which never asks.
CONVERTER = """
import runpy, sys
script = sys.argv.pop(1)
sys.path.insert(0, str(__import__("pathlib").Path(script).parent))
from conversion import base
known = base.TextModel.get_vocab_base_pre
def get_vocab_base_pre(self, tokenizer):
    try:
        return known(self, tokenizer)
    except NotImplementedError:
        print("pdserve: pre-tokenizer not recognized, written as 'default'", file=sys.stderr)
        return "default"
base.TextModel.get_vocab_base_pre = get_vocab_base_pre
sys.argv[0] = script
runpy.run_path(script, run_name="__main__")
"""


def convert(info: dict, model_dir: str | Path, out: Path, outtype: str = "bf16") -> Path:
    """``convert_hf_to_gguf.py`` on a Hugging Face checkpoint (``outtype`` f32/f16/bf16); cached by path. A BPE
    pre-tokenizer the converter does not recognize is written as llama.cpp's ``default`` (:data:`CONVERTER`).

    Raises:
        subprocess.CalledProcessError: the converter failed.
    """
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    model_dir = _with_input_embedding(Path(model_dir), out.parent / f"{out.stem}.hf")
    env = dict(os.environ, PYTHONPATH=f"{Path(info['src']) / 'gguf-py'}{os.pathsep}{converter_deps()}")
    subprocess.run([sys.executable, "-c", CONVERTER, str(Path(info["src"]) / "convert_hf_to_gguf.py"), str(model_dir),
                    "--outtype", outtype, "--outfile", str(out)], check=True, env=env,
                   stdout=subprocess.DEVNULL, stderr=open(out.with_suffix(".log"), "w"))
    return out


def _with_input_embedding(model_dir: Path, staging: Path) -> Path:
    """``model_dir``, or a staged copy of it where a tied checkpoint that stores only ``lm_head.weight``
    (as the embedded TinyStories model does) also carries it as ``model.embed_tokens.weight``: the
    converter maps each to its own GGUF tensor and llama.cpp needs ``token_embd.weight``. Same values."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    files = sorted(model_dir.glob("*.safetensors"))
    names = set()
    for f in files:
        with safe_open(f, "pt") as st:
            names |= set(st.keys())
    if "model.embed_tokens.weight" in names or "lm_head.weight" not in names or len(files) != 1:
        return model_dir
    staging.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            (staging / f.name).write_bytes(f.read_bytes())
    with safe_open(files[0], "pt") as st:
        tensors = {k: st.get_tensor(k) for k in st.keys()}
    tensors["model.embed_tokens.weight"] = tensors["lm_head.weight"].clone()
    save_file(tensors, staging / files[0].name, metadata={"format": "pt"})
    return staging


def quantize(info: dict, src: Path, out: Path, qtype: str) -> Path:
    """``llama-quantize src out qtype`` (e.g. ``Q4_0``, ``Q4_K_M``); cached by path.

    Raises:
        subprocess.CalledProcessError: quantization failed.
    """
    if not out.exists():
        subprocess.run([str(Path(info["bin"]) / "llama-quantize"), str(src), str(out), qtype], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return out


if __name__ == "__main__":
    print(json.dumps(build(), indent=2))
