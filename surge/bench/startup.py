"""`surge bench startup`: cold start (weights from disk) against warm start (weights from the weight-cache daemons),
each engine in a fresh process: weight-load seconds (with GB/s), time from process start to first token, and where
that time went (interpreter + imports, CUDA context, weights, KV cache allocation, kernel warm-up, CUDA graph
capture, the rest of the engine's construction, the first step).

Both engines use one private set of on-disk caches, empty for the cold start and as it left them for the warm one (a
restart on the same node): Triton's compiled kernels, and Python's bytecode where the environment would not write it
(PYTHONDONTWRITEBYTECODE, as some images set, makes every process compile torch's ~2,000 modules from source:
seconds of imports that an installed package does not pay). `--no-bytecode-cache` measures the environment as is.

`--preset NAME --checkpoint-dir DIR` first writes the preset's random weights there as an HF checkpoint (kept for
later runs). There is no tokenizer: the prompt is random token ids. The daemons are started in a private temporary
directory and stopped afterwards, unless --use-daemon names the socket directory of running ones.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from surge.bench.common import add_model_args
from surge.engine.args import EngineArgs

_RESULT = "SURGE_STARTUP_RESULT "
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])


def add_startup_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    g = p.add_argument_group("startup")
    g.add_argument("--checkpoint-dir", default=None, help="with --preset: the preset's random weights as an HF "
                   "checkpoint in this directory, written when missing")
    g.add_argument("--use-daemon", default=None, metavar="DIR", help="socket directory of running weight-cache "
                   "daemons (default: start them in a temporary directory and stop them after)")
    g.add_argument("--input-len", type=int, default=16, help="prompt tokens of the first request")
    g.add_argument("--parity", action="store_true", help="then compare the daemon's tensors with a disk load "
                   "(names, shapes, dtypes, strides, sha256; tensor_parallel_size 1)")
    g.add_argument("--bytecode-cache", action=argparse.BooleanOptionalAction, default=True,
                   help="keep the engines' Python bytecode in the benchmark's cache directory even where the "
                   "environment disables writing it (default: on; --no-bytecode-cache: the environment as is)")
    g.add_argument("--timeout", type=float, default=1800.0, help="seconds allowed to each engine process and to the "
                   "daemons' start")


def _env(cache_dir: str | None = None, bytecode: bool = False) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
    if cache_dir is not None:
        env["TRITON_CACHE_DIR"] = os.path.join(cache_dir, "triton")
        if bytecode:
            env.pop("PYTHONDONTWRITEBYTECODE", None)
            env["PYTHONPYCACHEPREFIX"] = os.path.join(cache_dir, "pycache")
    return env


def child_main() -> None:
    """One engine in a fresh process: build it, take one request to its first token, report on stdout. The imports
    are done when this runs (they came with this module); the phases after them are timed here."""
    imported_at = time.monotonic()
    spec = json.loads(sys.stdin.read())
    from surge.bench.common import make_workload, run_engine
    from surge.engine.core import EngineCore
    config = EngineArgs(**spec["engine"]).create_engine_config()
    cuda_seconds = 0.0
    if config.device.type == "cuda":  # the context, on its own: the engine's other phases then exclude it
        start = time.monotonic()
        torch.empty(1, device=config.device)
        cuda_seconds = time.monotonic() - start
    engine = EngineCore(config)
    ready_at = time.monotonic()
    mc = engine.config.model_config
    prompt, _ = make_workload(1, spec["input_len"], 1, 0.0, mc.vocab_size, 0)[0]
    run_engine(engine, [(prompt, 1)], show_progress=False)
    first_token_at = time.monotonic()
    runner = getattr(engine.executor, "runner", None)  # the in-process runner's phases (tp == 1) only
    graphs = runner.graph_runner if runner is not None else None
    if graphs is not None:
        graphs.wait()  # the graphs captured while serving: when the last one was ready
    graphs_done_at = time.monotonic()
    print(_RESULT + json.dumps({"load_seconds": engine.executor.load_seconds, "imported_at": imported_at,
                                "cuda_seconds": cuda_seconds, "ready_at": ready_at,
                                "first_token_at": first_token_at,
                                "kv_cache_seconds": runner.kv_cache_seconds if runner is not None else 0.0,
                                "warmup_seconds": runner.warmup_seconds if runner is not None else 0.0,
                                "capture_seconds": graphs.capture_seconds if graphs is not None else 0.0,
                                "background_capture_seconds": graphs.background_seconds if graphs else 0.0,
                                "graphs_done_at": graphs_done_at}),
          flush=True)
    engine.shutdown()


def phases(r: dict) -> list[tuple[str, float]]:
    """A child's report as (phase, seconds) from process start to first token; the phases add up to the total."""
    engine = r["ready_from_start"] - r["imports_from_start"] - r["cuda_seconds"]
    timed = [("weights", r["load_seconds"]), ("KV cache allocation", r["kv_cache_seconds"]),
             ("kernel warm-up", r["warmup_seconds"]), ("CUDA graph capture", r["capture_seconds"])]
    return ([("interpreter + imports", r["imports_from_start"]), ("CUDA context", r["cuda_seconds"])] + timed
            + [("engine, other", engine - sum(s for _, s in timed)),
               ("first step", r["ttft_from_start"] - r["ready_from_start"])])


def _run_child(engine: EngineArgs, input_len: int, timeout: float, what: str, env: dict) -> dict:
    print(f"{what}: starting a fresh engine process", flush=True)
    spawned_at = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", "from surge.bench.startup import child_main; child_main()"],
                          input=json.dumps({"engine": dataclasses.asdict(engine), "input_len": input_len}),
                          stdout=subprocess.PIPE, text=True, env=env, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(_RESULT)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{what}: the engine process exited with code {proc.returncode} (its log is above)")
    result = json.loads(lines[-1][len(_RESULT):])
    result["ttft_from_start"] = result["first_token_at"] - spawned_at
    result["ready_from_start"] = result["ready_at"] - spawned_at
    result["imports_from_start"] = result["imported_at"] - spawned_at
    result["graphs_from_start"] = result["graphs_done_at"] - spawned_at
    background = (f" (+{result['background_capture_seconds']:.2f} s while serving, every graph ready "
                  f"{result['graphs_from_start']:.2f} s after the start)" if result["background_capture_seconds"]
                  else "")
    print(f"{what}: weights in {result['load_seconds']:.2f} s, kernel warm-up {result['warmup_seconds']:.2f} s, "
          f"CUDA graph capture {result['capture_seconds']:.2f} s{background}, ready "
          f"{result['ready_from_start']:.2f} s and first token {result['ttft_from_start']:.2f} s after the process "
          "started", flush=True)
    return result


class _Daemons:
    """`surge weight-cache serve` in a subprocess, ready when every socket answers `health` with "ready"."""

    def __init__(self, engine: EngineArgs, socket_dir: str, timeout: float) -> None:
        cmd = [sys.executable, "-m", "surge.entrypoints.cli.main", "weight-cache", "serve", str(engine.model),
               "--dtype", str(engine.dtype), "-tp", str(engine.tensor_parallel_size), "--weight-cache-dir", socket_dir]
        for flag, value in (("--device", engine.device), ("--max-model-len", engine.max_model_len)):
            if value is not None:
                cmd += [flag, str(value)]
        self.socket_dir, self.tp = Path(socket_dir), engine.tensor_parallel_size
        self.proc = subprocess.Popen(cmd, env=_env(), stdin=subprocess.DEVNULL)
        try:
            self.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise

    def wait_ready(self, timeout: float) -> None:
        from surge.weight_cache.launcher import socket_states
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the weight-cache daemons exited with code {self.proc.returncode} (log above)")
            states = socket_states(self.socket_dir)
            if len(states) == self.tp and set(states.values()) == {"ready"}:
                return
            time.sleep(0.1)
        raise TimeoutError(f"the weight-cache daemons were not ready within {timeout:.0f} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _daemon_memory(socket_dir: Path) -> int:
    from surge.weight_cache.protocol import DaemonClient, GetMemory, MemoryReply
    total = 0
    for path in Path(socket_dir).glob("*.sock"):
        with DaemonClient(path, 5.0) as client:
            reply = client.request(GetMemory())
        if isinstance(reply, MemoryReply):
            total += reply.device_bytes
    return total


def _parity(engine: EngineArgs) -> list[str]:
    """The daemon's rank-0 tensors (mapped, zero copy) against a disk load of the same checkpoint on the CPU."""
    from surge.model.loader.base import load_from_disk
    from surge.weight_cache.ipc_loader import fetch_model
    from surge.weight_cache.parity import diff_fingerprints, fingerprint
    config = dataclasses.replace(engine, weight_cache_mode="zero_copy").create_engine_config()
    cached = fingerprint(fetch_model(config, config.device, 0))
    gc.collect()  # the mapping goes before the daemons do
    disk = fingerprint(load_from_disk(config.model_config, torch.device("cpu")))
    return diff_fingerprints(cached, disk)


def run_startup(args: argparse.Namespace) -> int:
    from surge.model.loader.base import build_model
    from surge.model.loader.preset_checkpoint import write_preset_checkpoint

    # --preset names the checkpoint to write, not the engine's model: the engines load that checkpoint.
    engine = dataclasses.replace(EngineArgs.from_cli_args(args), preset=None)
    if args.preset:
        if engine.model:
            raise ValueError("give --model or --preset, not both")
        if not args.checkpoint_dir:
            raise ValueError("--preset needs --checkpoint-dir: a warm start serves a checkpoint, so the preset's "
                             "random weights are written there first")
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        start = time.perf_counter()
        path = write_preset_checkpoint(args.preset, args.checkpoint_dir, args.dtype, device, seed=args.engine_seed)
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the engines measured next see the whole device
        print(f"checkpoint: preset {args.preset} in {path} ({time.perf_counter() - start:.1f} s)", flush=True)
        engine = dataclasses.replace(engine, model=str(path))
    elif args.checkpoint_dir:
        raise ValueError("--checkpoint-dir goes with --preset (give a checkpoint itself with --model)")
    if engine.nnodes != 1:
        raise ValueError("surge bench startup runs on one node (--nnodes 1)")
    engine = dataclasses.replace(engine, load_format="safetensors")
    config = engine.create_engine_config()  # validates the options once, before any process starts
    engine = dataclasses.replace(engine, model=config.model_config.model)
    mc = config.model_config
    weights = sum(p.numel() * p.element_size() for p in build_model(mc, torch.device("meta")).parameters())
    print(f"startup of {mc.model}: {mc.architecture}, {mc.dtype}, tp={config.parallel_config.tensor_parallel_size}, "
          f"{config.device}, {weights / 1e9:.2f} GB of weights", flush=True)

    cache_dir = tempfile.mkdtemp(prefix="surge-startup-caches-")
    env = _env(cache_dir, args.bytecode_cache)
    print(f"caches: Triton kernels{' and Python bytecode' if args.bytecode_cache else ''} in {cache_dir}, empty "
          "for the cold start", flush=True)
    try:
        cold = _run_child(engine, args.input_len, args.timeout, "cold start (disk)", env)
        warm, parity = _warm_start(args, engine, env)
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
    _report(cold, warm, weights)
    if parity is not None:
        if parity:
            print(f"parity: {len(parity)} difference(s) between the daemon's tensors and a disk load:")
            for line in parity[:20]:
                print(f"  {line}")
            return 1
        print("parity: the daemon's tensors equal a disk load (names, shapes, dtypes, strides, sha256)")
    return 0


def _warm_start(args: argparse.Namespace, engine: EngineArgs, env: dict) -> tuple[dict, list[str] | None]:
    """The daemons (started here unless --use-daemon), then an engine that takes its weights from them; with
    --parity, the differences between the daemon's tensors and a disk load (None: not compared)."""
    tmp_dir = None if args.use_daemon else tempfile.mkdtemp(prefix="surge-wc-")
    socket_dir = args.use_daemon or tmp_dir
    daemons = None
    try:
        if tmp_dir is not None:
            start = time.perf_counter()
            daemons = _Daemons(engine, socket_dir, args.timeout)
            print(f"weight-cache daemons (sockets in {socket_dir}) ready in {time.perf_counter() - start:.1f} s, "
                  f"holding {_daemon_memory(Path(socket_dir)) / 1e9:.2f} GB", flush=True)
        warm_engine = dataclasses.replace(engine, load_format="weight_cache", weight_cache_dir=socket_dir,
                                          weight_cache_fallback=False)
        warm = _run_child(warm_engine, args.input_len, args.timeout, "warm start (daemon)", env)
        parity = None
        if args.parity and engine.tensor_parallel_size == 1 and engine.weight_cache_mode == "zero_copy":
            parity = _parity(warm_engine)
        elif args.parity:
            print("parity: skipped (it needs tensor_parallel_size 1, and daemons a copy-mode engine has not "
                  "released)", flush=True)
    finally:
        if daemons is not None:
            daemons.stop()
        if tmp_dir is not None:
            shutil.rmtree(tmp_dir, ignore_errors=True)
    return warm, parity


def _report(cold: dict, warm: dict, weights: int) -> None:
    def row(name: str, r: dict) -> str:
        rate = weights / r["load_seconds"] / 1e9 if r["load_seconds"] > 0 else float("inf")
        return (f"{name:<16}{r['load_seconds']:>9.2f} s {rate:>8.1f} GB/s{r['ready_from_start']:>13.2f} s"
                f"{r['ttft_from_start']:>14.2f} s")
    print(f"{'':<16}{'weight load':>24}{'ready':>15}{'first token':>16}   (from process start)")
    print(row("cold (disk)", cold))
    print(row("warm (daemon)", warm))
    print(f"{'speed-up':<16}{cold['load_seconds'] / max(warm['load_seconds'], 1e-9):>10.1f}x{'':<13}"
          f"{cold['ready_from_start'] / warm['ready_from_start']:>14.1f}x"
          f"{cold['ttft_from_start'] / warm['ttft_from_start']:>15.1f}x", flush=True)
    print(f"{'phase':<24}{'cold (disk)':>14}{'warm (daemon)':>16}")
    for (name, cold_s), (_, warm_s) in zip(phases(cold), phases(warm)):
        print(f"{name:<24}{cold_s:>12.2f} s{warm_s:>14.2f} s")
    print(f"{'first token':<24}{cold['ttft_from_start']:>12.2f} s{warm['ttft_from_start']:>14.2f} s", flush=True)
    if cold["background_capture_seconds"] or warm["background_capture_seconds"]:
        print(f"{'every CUDA graph ready':<24}{cold['graphs_from_start']:>12.2f} s{warm['graphs_from_start']:>14.2f} s"
              "   (captured while serving)", flush=True)
