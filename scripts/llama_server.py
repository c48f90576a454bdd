"""Build llama.cpp's ``llama-server`` and a tiny random-weight model for it, offline.

The test suite's real-server tier runs against an unmodified third-party
OpenAI-compatible server. Everything it needs is made here from packages and local
text, nothing from a model hub:

1. the ``llama-cpp-python`` sdist from PyPI (pip), whose ``vendor/llama.cpp`` holds the
   C++ sources and ``convert_hf_to_gguf.py``;
2. ``llama-server`` built with cmake (that target only; about 6 minutes on 2 cores);
3. a tools venv (torch, transformers, sentencepiece) for the model;
4. a tiny Llama (``scripts/tiny_llama.py``), converted to GGUF.

Each step leaves its result in the cache directory and is skipped when the result is
there: a second run takes about a second. The cache is keyed by the llama-cpp-python
version; the model also by ``RECIPE``. ``ORCHESTRATOR_LLAMA_DIR`` overrides the
directory (default ``~/.cache/orchestrator/llama-server/<version>/``). The binary is
built with ``-DGGML_NATIVE=ON``: it fits the CPU it was built on only.

    python3 scripts/llama_server.py            # build what is missing, print the paths
    python3 scripts/llama_server.py --check    # exit 1 if anything is missing
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

VERSION = "0.3.36"  # llama-cpp-python, whose sdist carries llama.cpp's sources
RECIPE = 1  # bump when scripts/tiny_llama.py makes a different model
MODEL_ALIAS = "tiny-llama"
HERE = Path(__file__).resolve().parent
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_CURL=OFF",
    "-DGGML_NATIVE=ON",
    "-DBUILD_SHARED_LIBS=OFF",
)
# The torch requirement alone is configurable (ORCHESTRATOR_LLAMA_TORCH): the model needs
# any recent CPU build, and a pinned one is not downloaded again where it is at hand.
TOOLS = (
    os.environ.get("ORCHESTRATOR_LLAMA_TORCH", "torch==2.13.0"),
    "transformers",
    "sentencepiece",
)
TOOLS_MORE = ("numpy", "safetensors", "pyyaml", "tqdm", "requests")


def cache_dir() -> Path:
    env = os.environ.get("ORCHESTRATOR_LLAMA_DIR")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "orchestrator" / "llama-server" / VERSION


def binary_path(cache: Path | None = None) -> Path:
    return (cache or cache_dir()) / "bin" / "llama-server"


def model_path(cache: Path | None = None) -> Path:
    return (cache or cache_dir()) / f"model-r{RECIPE}" / "tiny-llama.gguf"


def _source(cache: Path) -> Path:
    return cache / "src" / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"


@contextlib.contextmanager
def _step(what: str, name: str) -> Iterator[None]:
    """Say what a long step is doing, and how long it took once it is done."""
    print(f"[llama-server] {what}", flush=True)
    started = time.monotonic()
    yield
    print(f"[llama-server] {name}: done in {time.monotonic() - started:.1f}s", flush=True)


def _run(*cmd: str | Path, **kwargs: object) -> None:
    subprocess.run([str(c) for c in cmd], check=True, **kwargs)  # type: ignore[call-overload]


def stop_process(proc: subprocess.Popen[bytes] | None, timeout: float = 10.0) -> None:
    """SIGTERM, and SIGKILL if it has not gone within ``timeout`` seconds."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def fetch_source(cache: Path) -> Path:
    """The sdist, downloaded with pip and unpacked (pip's cache makes a rerun quick)."""
    src = _source(cache)
    if (src / "CMakeLists.txt").exists():
        return src
    with _step(f"downloading the llama-cpp-python {VERSION} sdist", "sdist"):
        sdist = cache / "sdist"
        _run(sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
             "-d", sdist, f"llama-cpp-python=={VERSION}")  # fmt: skip
        archive = next(sdist.glob(f"llama_cpp_python-{VERSION}.tar.gz"))
        with tarfile.open(archive) as tar:
            tar.extractall(cache / "src", filter="data")
    return src


def build(cache: Path) -> Path:
    """cmake, the llama-server target only; the binary is copied out of the build tree."""
    binary = binary_path(cache)
    if binary.exists():
        return binary
    missing = [tool for tool in ("cmake", "c++") if shutil.which(tool) is None]
    if missing:
        raise SystemExit(
            f"[llama-server] {' and '.join(missing)} not found: the build needs cmake and a "
            "C++ compiler (Debian: apt-get install cmake g++)"
        )
    src = fetch_source(cache)
    jobs = str(os.cpu_count() or 2)
    with _step(f"building llama-server with {jobs} jobs (about 6 min on 2 cores)", "build"):
        if not (src / "build" / "CMakeCache.txt").exists():
            _run("cmake", "-S", src, "-B", src / "build", *CMAKE_FLAGS)
        _run("cmake", "--build", src / "build", "--target", "llama-server", "-j", jobs)
        binary.parent.mkdir(parents=True, exist_ok=True)
        tmp = binary.with_suffix(".tmp")
        shutil.copy2(src / "build" / "bin" / "llama-server", tmp)
        tmp.replace(binary)
    return binary


def tools_python(cache: Path) -> Path:
    """A venv of its own for torch and transformers: the project's venv stays lean."""
    venv = cache / "tools"
    python = venv / "bin" / "python"
    marker = venv / ".complete"
    if marker.exists():
        return python
    with _step("creating the tools venv (torch, transformers, sentencepiece)", "tools venv"):
        if not python.exists():
            _run(sys.executable, "-m", "venv", venv)
        _run(python, "-m", "pip", "install", "-q", *TOOLS, *TOOLS_MORE)
        marker.write_text("ok\n")
    return python


def make_model(cache: Path) -> Path:
    """The tiny Llama in Hugging Face layout, then GGUF by the vendored converter."""
    gguf = model_path(cache)
    if gguf.exists():
        return gguf
    src = fetch_source(cache)
    python = tools_python(cache)
    with _step("making the tiny model and converting it to GGUF", "model"):
        hf = gguf.parent / "hf"
        if hf.exists():
            shutil.rmtree(hf)
        _run(python, HERE / "tiny_llama.py", hf)
        env = {**os.environ, "PYTHONPATH": str(src / "gguf-py")}
        tmp = gguf.with_suffix(".tmp")
        convert = [str(python), str(src / "convert_hf_to_gguf.py"), str(hf), "--outfile", str(tmp),
                   "--outtype", "f32"]  # fmt: skip
        done = subprocess.run(convert, env=env, capture_output=True, text=True)
        if done.returncode != 0:  # its log is long: shown only when it failed
            sys.stderr.write(done.stdout + done.stderr)
            raise subprocess.CalledProcessError(done.returncode, convert)
        tmp.replace(gguf)
    return gguf


class LlamaServer:
    """``llama-server`` on a free loopback port, started and stopped as a process.

    ``-np`` slots share the ``-c`` context (4,096 tokens each by default); ``--metrics``
    turns on ``/metrics`` (``llamacpp:*`` names). One compute thread: ggml's threads spin
    while they wait, and on a shared 2-core machine a second one made every request ten
    times slower (86 ms against 8 ms) for a model this small.
    """

    def __init__(self, *extra: str, slots: int = 8, context: int = 32768) -> None:
        self.args = ("-c", str(context), "-np", str(slots), "-t", "1", "--metrics", *extra)
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""
        # A file, not a pipe: it logs a few lines per request, and a full pipe nobody
        # reads stops the server dead.
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 (lives as long as the server)

    def start(self, timeout: float = 60.0) -> str:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        cmd = [str(binary_path()), "-m", str(model_path()), "-a", MODEL_ALIAS,
               "--host", "127.0.0.1", "--port", str(port), *self.args]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited {self.proc.returncode}: {self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        return self.url
            except (OSError, urllib.error.URLError):
                pass  # not listening yet, or 503 while the model loads
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"llama-server did not answer /health within {timeout:g}s")

    def stop(self) -> None:
        stop_process(self.proc)

    def tail(self, size: int = 4000) -> str:
        """The end of the server's log."""
        self.log.seek(0, os.SEEK_END)
        self.log.seek(max(0, self.log.tell() - size))
        return self.log.read().decode("utf-8", "replace")

    def __enter__(self) -> LlamaServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if anything is missing")
    args = parser.parse_args(argv)
    cache = cache_dir()
    if args.check:
        missing = [p for p in (binary_path(cache), model_path(cache)) if not p.exists()]
        for path in missing:
            print(f"missing: {path}", file=sys.stderr)
        return 1 if missing else 0
    cache.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    binary, model = build(cache), make_model(cache)
    print(f"[llama-server] ready in {time.monotonic() - started:.1f}s: {binary} {model}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
