"""Launch Triton Inference Server on an engine: `python -m model_repo.serve --engine build/engine-tiny`.

The server is the `tritonserver` binary of the `nvidia-pytriton` wheel, run as pytriton itself runs it
(pytriton/triton.py): its directory copied without the Python backend stubs, the stub built for this
Python copied into `backends/python/`, the wheel's bundled libraries on LD_LIBRARY_PATH and the venv's
`bin/` first on PATH, so that the stub's embedded interpreter finds the venv (pyvenv.cfg) and with it
torch and this project. The model repository is filled from `model_repo/templates/` into a build dir.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import signal
import socket
import string
import subprocess
import sys
import sysconfig
import time
import urllib.request
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent
TEMPLATES = Path(__file__).resolve().parent / "templates"
STUB_NUMPY = "1.26.4"
MODELS = ("preprocessing", "image_encoder", "audio_encoder", "inkling", "ensemble", "ensemble_unary")


class ServeError(RuntimeError):
    """The server could not be prepared or did not become ready."""


@dataclass(frozen=True)
class ServeConfig:
    """What `make serve` and the tests choose: engine, where to write, ports, instances, limits."""

    engine_dir: str
    work_dir: str = "build/serve"
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    instances: Mapping[str, int] = field(
        default_factory=lambda: {"preprocessing": 1, "image_encoder": 1, "audio_encoder": 1}
    )
    # Request limits, enforced by `preprocessing` before anything is decoded.
    max_text_bytes: int = 1 << 20
    max_images: int = 8
    max_audios: int = 4
    max_image_bytes: int = 8 << 20
    max_image_pixels: int = 4096 * 4096
    max_audio_bytes: int = 16 << 20
    max_audio_seconds: float = 120.0
    stub_env: str = str(
        PROJECT_ROOT / "build" / "triton-env"
    )  # the stubs' Python environment (prepare_stub_env)
    num_blocks: int = 0  # 0: the runtime's default
    engine_threads: int = 0  # torch threads of the engine loop (0: torch's default)
    cuda_graphs: bool | None = None  # decode/verify steps from CUDA graphs (None: the runtime's default)
    overlap: bool | None = None  # overlapped decode steps (None: the runtime's default)
    max_prefill_pairs: int = 0  # beside decodes, a chunk's tokens x (context + tokens) within it (0: no cap)
    decode_slowdown: float = 0.0  # beside a prefill, decodes' mean step within this x their own (0: unpaced)
    engine_process: bool = True  # the engine in a process of its own (runtime.engine_process), not the stub's
    log_verbose: int = 0

    def __post_init__(self) -> None:
        if not os.path.isfile(os.path.join(self.engine_dir, "config.json")):
            raise ServeError(f"no engine at {self.engine_dir} (build one with `make engine`)")
        unknown = set(self.instances) - {"preprocessing", "image_encoder", "audio_encoder"}
        if unknown:
            raise ServeError(f"instance counts for {sorted(unknown)}: only the stateless models scale")
        if any(n < 1 for n in self.instances.values()):
            raise ServeError(f"instance counts must be positive, got {dict(self.instances)}")
        for port in (self.http_port, self.grpc_port, self.metrics_port):
            if not 0 < port < 65536:
                raise ServeError(f"port {port} outside 1..65535")

    @property
    def http_url(self) -> str:
        return f"{self.host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"


# The server distribution inside the wheel.
def pytriton_dist() -> Path:
    # Found, not imported: pytriton's own Python API needs dependencies we install without.
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise ServeError(
            "nvidia-pytriton is not installed: `pip install --no-deps nvidia-pytriton==0.7.0` (make venv)"
        )
    return Path(next(iter(spec.submodule_search_locations))).resolve()


def prepare_server(dest: Path) -> Path:
    """Copy the wheel's tritonserver (bin, backends, caches) to `dest` with this Python's stub
    in backends/python; reused while the wheel is unchanged. Returns `dest`."""
    dist = pytriton_dist() / "tritonserver"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = dist / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        raise ServeError(f"nvidia-pytriton has no Python backend stub for Python {version} ({stub})")
    stamp = dest / ".source"
    source = f"{dist} {stub.stat().st_mtime_ns}"
    if stamp.is_file() and stamp.read_text() == source:
        return dest
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(dist, dest, ignore=shutil.ignore_patterns("python_backend_stubs", "__pycache__"))
    shutil.copy2(stub, dest / "backends" / "python" / "triton_python_backend_stub")
    stamp.write_text(source)
    return dest


def prepare_stub_env(stub_env: str) -> Path:
    """The stubs' Python environment. The wheel's stubs are built against the NumPy 1 C API and
    misread NumPy 2 arrays, and their embedded interpreter ignores PYTHONPATH; it finds its prefix
    from the `python3` first on PATH. So the stubs get a venv of their own holding NumPy 1, whose
    .pth file adds this project and the main venv's site-packages after it (torch and scipy accept
    either NumPy); the main venv keeps NumPy 2. Made here when missing (pip, from the registry)."""
    env = Path(stub_env).resolve()
    site = env / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    if not (env / "pyvenv.cfg").is_file() or not any(site.glob(f"numpy-{STUB_NUMPY}.dist-info")):
        shutil.rmtree(env, ignore_errors=True)
        install = [
            [sys.executable, "-m", "venv", "--without-pip", str(env)],
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "-q",
                "--no-deps",
                "--target",
                str(site),
                f"numpy=={STUB_NUMPY}",
            ],
        ]
        for cmd in install:
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode:
                raise ServeError(
                    f"cannot make the stubs' environment: {' '.join(cmd)}:\n{done.stderr[-2000:]}"
                )
    main_site = sysconfig.get_paths()["purelib"]
    lines = [
        str(PROJECT_ROOT),
        f"import site; site.addsitedir({main_site!r})",
        # The embedded interpreter leaves the C locale (ASCII) whatever the environment says.
        "import locale; locale.setlocale(locale.LC_CTYPE, 'C.UTF-8')",
    ]
    (site / "inkling_serving.pth").write_text("\n".join(lines) + "\n")
    return env


def server_env(stub_env: Path, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of tritonserver and its stubs: the wheel's libraries and this interpreter's
    libpython (the stub links libpython3.X.so), the stubs' venv first on PATH."""
    env = dict(os.environ if base is None else base)
    libs = [str(pytriton_dist().parent / "nvidia_pytriton.libs")]
    libdir = sysconfig.get_config_var("LIBDIR")
    if libdir and os.path.exists(os.path.join(libdir, sysconfig.get_config_var("LDLIBRARY") or "")):
        libs.insert(0, libdir)
    env["LD_LIBRARY_PATH"] = ":".join(libs + [p for p in env.get("LD_LIBRARY_PATH", "").split(":") if p])
    env["PATH"] = f"{stub_env / 'bin'}:{env.get('PATH', '')}"
    env.pop("PYTHONPATH", None)
    env.pop("PYTHONHOME", None)
    env.pop("TRITON_INTERPRET", None)
    return env


# The model repository.
SWITCH = {None: "auto", True: "1", False: "0"}  # a tri-state option as the `inkling` model reads it


def template_values(cfg: ServeConfig) -> dict[str, str]:
    values = {
        "engine_dir": os.path.abspath(cfg.engine_dir),
        "num_blocks": str(cfg.num_blocks),
        "engine_threads": str(cfg.engine_threads),
        "cuda_graphs": SWITCH[cfg.cuda_graphs],
        "overlap": SWITCH[cfg.overlap],
        "max_prefill_pairs": str(cfg.max_prefill_pairs),
        "decode_slowdown": str(cfg.decode_slowdown),
        "engine_process": SWITCH[cfg.engine_process],
        "max_text_bytes": str(cfg.max_text_bytes),
        "max_images": str(cfg.max_images),
        "max_audios": str(cfg.max_audios),
        "max_image_bytes": str(cfg.max_image_bytes),
        "max_image_pixels": str(cfg.max_image_pixels),
        "max_audio_bytes": str(cfg.max_audio_bytes),
        "max_audio_seconds": str(cfg.max_audio_seconds),
    }
    values["image_patch_dims"] = "2, 40, 40, 3"  # one image patch: 40x40 pixels duplicated in time
    defaults = {"preprocessing": 1, "image_encoder": 1, "audio_encoder": 1}
    for model, count in {**defaults, **cfg.instances}.items():
        values[f"{model}_instances"] = str(count)
    return values


def fill_repository(cfg: ServeConfig, dest: Path) -> Path:
    """templates/<model>/{config.pbtxt, 1/model.py} -> dest/<model>/..., ${name} filled in config.pbtxt."""
    values = template_values(cfg)
    shutil.rmtree(dest, ignore_errors=True)
    for model in MODELS:
        src = TEMPLATES / model
        shutil.copytree(src, dest / model, ignore=shutil.ignore_patterns("__pycache__"))
        text = (src / "config.pbtxt").read_text()
        try:
            (dest / model / "config.pbtxt").write_text(string.Template(text).substitute(values))
        except (KeyError, ValueError) as e:
            raise ServeError(f"template {src / 'config.pbtxt'}: no value for {e}") from e
    return dest


def server_command(cfg: ServeConfig, server_dir: Path, repo: Path) -> list[str]:
    shm_prefix = f"inkling_{os.getpid()}_{uuid.uuid4().hex[:8]}_"
    return [
        str(server_dir / "bin" / "tritonserver"),
        f"--model-repository={repo}",
        f"--backend-directory={server_dir / 'backends'}",
        f"--cache-directory={server_dir / 'caches'}",
        f"--http-address={cfg.host}",
        f"--http-port={cfg.http_port}",
        f"--grpc-address={cfg.host}",
        f"--grpc-port={cfg.grpc_port}",
        f"--metrics-address={cfg.host}",
        f"--metrics-port={cfg.metrics_port}",
        "--allow-gpu-metrics=false",
        "--allow-sagemaker=false",
        "--allow-vertex-ai=false",
        "--strict-readiness=true",
        "--disable-auto-complete-config",
        "--exit-on-error=true",
        "--exit-timeout-secs=5",
        f"--log-verbose={cfg.log_verbose}",
        f"--backend-config=python,shm-region-prefix-name={shm_prefix}",
        "--backend-config=python,shm-default-byte-size=16777216",
        "--backend-config=python,shm-growth-byte-size=16777216",
    ]


class TritonServer:
    """One tritonserver process: `with TritonServer(cfg) as server: ...` starts it, waits until every
    model is ready, and stops it (SIGINT, then SIGKILL after the exit timeout) on leaving."""

    def __init__(self, cfg: ServeConfig, log_path: str | None = None):
        self.cfg = cfg
        self.work_dir = Path(cfg.work_dir).resolve()
        self.log_path = Path(log_path) if log_path else self.work_dir / "tritonserver.log"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        stub_env = prepare_stub_env(self.cfg.stub_env)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        server_dir = prepare_server(self.work_dir / "tritonserver")
        repo = fill_repository(self.cfg, self.work_dir / "model_repository")
        log = open(self.log_path, "wb")
        self.process = subprocess.Popen(
            server_command(self.cfg, server_dir, repo),
            env=server_env(stub_env),
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=str(PROJECT_ROOT),
            start_new_session=True,  # Ctrl-C in a terminal reaches us, and we stop the server in order
        )
        log.close()

    def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        url = f"http://{self.cfg.http_url}/v2/health/ready"
        while time.monotonic() < deadline:
            if self.process is None or self.process.poll() is not None:
                raise ServeError(f"tritonserver exited during start-up; log:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.25)
        raise ServeError(f"tritonserver not ready after {timeout:.0f} s; log:\n{self.log_tail()}")

    def stop(self, timeout: float = 30.0) -> int | None:
        if self.process is None or self.process.poll() is not None:
            return None if self.process is None else self.process.returncode
        self.process.send_signal(signal.SIGINT)
        try:
            code = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            code = None
        try:  # the server and any stub it left behind: its own session, started by us
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return self.process.wait() if code is None else code

    def log_tail(self, num_chars: int = 6000) -> str:
        """The end of the server's log, after its error lines (E...), which a long status table
        printed at shutdown would otherwise push out of the tail."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        errors = [line for line in text.splitlines() if line.startswith("E") and "] " in line]
        head = "\n".join(errors)[-num_chars:]
        return (f"error lines:\n{head}\n\nlog tail:\n" if errors else "") + text[-num_chars:]

    def __enter__(self) -> TritonServer:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class OpenAIServer:
    """The OpenAI-compatible front (model_repo/openai_front.py) in a process of its own, speaking to a ready
    Triton's gRPC port: `with OpenAIServer(cfg, port) as front: front.url` ("http://host:port/v1")."""

    def __init__(
        self,
        cfg: ServeConfig,
        port: int,
        model: str = "inkling",
        log_path: str | None = None,
        extra: tuple = (),
    ):
        self.cfg, self.port, self.model, self.extra = cfg, port, model, tuple(extra)
        self.log_path = Path(log_path) if log_path else Path(cfg.work_dir).resolve() / "openai.log"
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.cfg.host}:{self.port}/v1"

    def start(self, timeout: float = 60.0) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb")
        cfg = self.cfg
        cmd = [sys.executable, "-m", "model_repo.openai_front", "--triton", cfg.grpc_url,
               "--triton-metrics", f"http://{cfg.host}:{cfg.metrics_port}/metrics",
               "--tokenizer", os.path.join(cfg.engine_dir, "tokenizer.json"),
               "--host", cfg.host, "--port", str(self.port), "--model", self.model, *self.extra]  # fmt: skip
        self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=str(PROJECT_ROOT))
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServeError(
                    f"the OpenAI front exited during start-up; log:\n{self.log_path.read_text()[-4000:]}"
                )
            try:
                with urllib.request.urlopen(f"{self.url}/models", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise ServeError(f"the OpenAI front not ready after {timeout:.0f} s")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def __enter__(self) -> OpenAIServer:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def parse_instances(items: list[str]) -> dict[str, int]:
    out = {}
    for item in items:
        name, _, count = item.partition("=")
        if not count.isdigit():
            raise argparse.ArgumentTypeError(f"--instances takes MODEL=COUNT, got {item!r}")
        out[name] = int(count)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m model_repo.serve", description=__doc__.split("\n")[0])
    p.add_argument("--engine", required=True, help="engine directory (make engine)")
    p.add_argument("--work-dir", default="build/serve", help="where the server and repository are written")
    p.add_argument("--host", default="127.0.0.1", help="address of all three endpoints (default localhost)")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=8001)
    p.add_argument("--metrics-port", type=int, default=8002)
    p.add_argument("--instances", nargs="*", default=[], help="MODEL=COUNT for the stateless models")
    p.add_argument("--stub-env", default=ServeConfig.stub_env, help="the stubs' venv, with NumPy 1")
    p.add_argument("--num-blocks", type=int, default=0, help="KV cache blocks (0: the runtime's default)")
    p.add_argument("--engine-threads", type=int, default=0, help="torch threads of the engine (0: default)")
    p.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        help="decode steps from CUDA graphs (default: on for a one-GPU engine with the Triton plugins)",
    )
    p.add_argument(
        "--overlap",
        action=argparse.BooleanOptionalAction,
        help="launch each decode step before the host reads the previous one's tokens (default: on for a "
        "one-GPU engine)",
    )
    p.add_argument(
        "--max-prefill-pairs",
        type=int,
        default=0,
        help="beside decoding requests, a prefill chunk keeps tokens x (context + tokens) within this, so a "
        "long prompt's chunks do not stretch their steps (e.g. 67108864 = 8192 x 8192; 0: whole chunks)",
    )
    p.add_argument(
        "--decode-slowdown",
        type=float,
        default=0.0,
        help="beside decoding requests, prefill chunks are paced so that those requests' mean inter-token "
        "latency stays within this multiple of their own (e.g. 2; 0: unpaced, the prompt's fastest first token)",
    )
    p.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the engine in a process of its own, apart from the `inkling` stub's GIL (default: on)",
    )
    p.add_argument("--log-verbose", type=int, default=0)
    p.add_argument("--openai-port", type=int, default=8080, help="the OpenAI-compatible API's port")
    p.add_argument("--no-openai", action="store_true", help="serve Triton alone, without the OpenAI API")
    p.add_argument("--model-name", default="inkling", help="the model's name in the OpenAI API")
    p.add_argument(
        "--allow-remote-media",
        action="store_true",
        help="the OpenAI API fetches http(s) image/audio URLs in chat messages (refused otherwise)",
    )
    args = p.parse_args(argv)
    cfg = ServeConfig(
        engine_dir=args.engine,
        work_dir=args.work_dir,
        host=args.host,
        http_port=args.http_port,
        grpc_port=args.grpc_port,
        metrics_port=args.metrics_port,
        instances={
            **ServeConfig.__dataclass_fields__["instances"].default_factory(),
            **parse_instances(args.instances),
        },
        stub_env=args.stub_env,
        num_blocks=args.num_blocks,
        engine_threads=args.engine_threads,
        cuda_graphs=args.cuda_graphs,
        overlap=args.overlap,
        max_prefill_pairs=args.max_prefill_pairs,
        decode_slowdown=args.decode_slowdown,
        engine_process=args.engine_process,
        log_verbose=args.log_verbose,
    )
    server = TritonServer(cfg)
    stopping = False

    def _stop(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)
    t0 = time.monotonic()
    server.start()
    remote = ("--allow-remote-media",) if args.allow_remote_media else ()
    front = None if args.no_openai else OpenAIServer(cfg, args.openai_port, args.model_name, extra=remote)
    try:
        server.wait_ready()
        print(
            f"Triton ready in {time.monotonic() - t0:.1f} s: HTTP {cfg.http_url}, gRPC {cfg.grpc_url}, "
            f"metrics {cfg.metrics_url}; models {', '.join(MODELS)}; log {server.log_path}",
            flush=True,
        )
        if front is not None:
            front.start()
            print(
                f"OpenAI-compatible API at {front.url} (model {args.model_name!r}); log {front.log_path}",
                flush=True,
            )
        while not stopping and server.process.poll() is None:
            time.sleep(0.5)
    finally:
        if front is not None:
            front.stop()
        code = server.stop()
    if not stopping:
        print(f"tritonserver exited with {code}; log:\n{server.log_tail()}", file=sys.stderr)
        return 1
    print("Triton stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
