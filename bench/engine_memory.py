"""Memory of a serving process: our engine's RSS (GGUF blocks as stored, --dequantize to
float32, and as stored with an int8 KV cache) against llama.cpp's ``llama-server`` on the
same GGUF, after load and at ``--num-streams`` concurrent requests, side by side in one run.

    python -m bench.engine_memory                  # the shipped SmolLM2 Q4_1, 32 streams
    python -m bench.engine_memory --num-streams 64 --prompt-len 512 --output-len 256

Each arm is its own process, started fresh each repeat: ours is ``python -m
backend_engine --model FILE --uds SOCK --dtype float32 [--dequantize] [--kv-cache-dtype
int8]`` with a KV budget of the blocks that hold ``--num-streams`` x (prompt + output + 16)
tokens (the same tokens as llama.cpp's context); llama.cpp is ``llama-server -np STREAMS
-c STREAMS x (prompt + output + 16)`` (its KV is float16 by default, ours
float32, twice theirs for the same tokens; int8, about half). Readings come from
``/proc/PID/status``:

- after load: ``VmRSS`` once the server is ready (``/ready`` for ours, ``/health`` for
  llama.cpp), before any request;
- at N streams: the highest ``VmRSS`` sampled (every 20 ms) while ``--num-streams``
  greedy requests of ``--prompt-len`` random tokens and ``--output-len`` outputs (end of
  sequence ignored) run at once, and ``VmHWM`` (the process's peak, load included) after.
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import httpx

if __package__ in (None, ""):  # run as `python bench/...py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.llamacpp_server import LlamaServer, add_llamacpp_args, llamacpp_arm, missing_binary_note
from bench.workloads import add_common_args, checkpoint, command_line, shipped_gguf

# Our arms: label -> (--dequantize, --kv-cache-dtype).
ARMS = {
    "tollway (GGUF blocks as stored)": (False, "auto"),
    "tollway --dequantize (float32)": (True, "auto"),
    "tollway (GGUF blocks as stored) --kv-cache-dtype int8": (False, "int8"),
}
_START_TIMEOUT_S = 300.0
_SAMPLE_EVERY_S = 0.02
_BLOCK_SIZE = 16  # EngineConfig's default block_size, which the engine runs with here


@dataclass(frozen=True)
class MemoryReading:
    after_load_kib: int  # VmRSS once the server is ready, before any request
    at_streams_kib: int  # highest VmRSS sampled while the streams ran
    peak_kib: int  # VmHWM afterwards: the process's peak, load included


def status_kib(status_text: str, field: str) -> int:
    """A ``/proc/PID/status`` field in KiB (``VmRSS:   123456 kB`` -> 123456)."""
    for line in status_text.splitlines():
        name, _, value = line.partition(":")
        if name == field:
            number, _, unit = value.strip().partition(" ")
            if unit != "kB":
                raise ValueError(f"{field} is in {unit!r}, not kB")
            return int(number)
    raise ValueError(f"no {field} in the status text")


def read_kib(pid: int, field: str) -> int:
    return status_kib(Path(f"/proc/{pid}/status").read_text(), field)


def measure(pid: int, run_streams: Callable[[], None]) -> MemoryReading:
    """The readings of process ``pid`` around ``run_streams`` (which sends the requests)."""
    after_load = read_kib(pid, "VmRSS")
    highest = after_load
    done = threading.Event()

    def sample() -> None:
        nonlocal highest
        while not done.is_set():
            highest = max(highest, read_kib(pid, "VmRSS"))
            time.sleep(_SAMPLE_EVERY_S)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        run_streams()
    finally:
        done.set()
        sampler.join()
    highest = max(highest, read_kib(pid, "VmRSS"))
    return MemoryReading(after_load, highest, read_kib(pid, "VmHWM"))


@contextmanager
def our_engine(
    model: str,
    dequantize: bool,
    kv_cache_dtype: str,
    num_threads: int,
    kv_bytes: int,
    num_streams: int,
) -> Iterator[tuple[subprocess.Popen[bytes], httpx.Client, list[str]]]:
    """Our engine serving ``model`` on a Unix socket, in its own process."""
    with tempfile.TemporaryDirectory() as tmp:
        socket_path = f"{tmp}/engine.sock"
        command = [
            sys.executable, "-m", "backend_engine", "--model", model, "--uds", socket_path,
            "--served-model-name", "bench", "--dtype", "float32",
            "--kv-cache-memory-bytes", str(kv_bytes), "--max-num-seqs", str(num_streams),
        ]  # fmt: skip
        if num_threads:
            command += ["--num-threads", str(num_threads)]
        if dequantize:
            command.append("--dequantize")
        if kv_cache_dtype != "auto":
            command += ["--kv-cache-dtype", kv_cache_dtype]
        # Its log goes to a file: a pipe nobody reads fills and then blocks the engine.
        log = Path(f"{tmp}/engine.log")
        with log.open("wb") as log_file:
            process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log_file)
        transport = httpx.HTTPTransport(uds=socket_path)
        client = httpx.Client(transport=transport, base_url="http://engine", timeout=600.0)
        try:
            _wait_healthy(process, client, log)
            yield process, client, command
        finally:
            client.close()
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _wait_healthy(process: subprocess.Popen[bytes], client: httpx.Client, log: Path) -> None:
    deadline = time.monotonic() + _START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            error = log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"the engine exited at start ({process.returncode}): {error}")
        try:
            if client.get("/ready").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the engine did not become healthy in {_START_TIMEOUT_S:.0f} s")


def our_streams(client: httpx.Client, prompts: list[list[int]], output_len: int) -> None:
    def one(prompt: list[int]) -> None:
        body = {
            "model": "bench",
            "prompt": prompt,
            "max_tokens": output_len,
            "temperature": 0,
            "ignore_eos": True,
        }
        response = client.post("/v1/completions", json=body)
        response.raise_for_status()
        usage = response.json()["usage"]
        if usage["completion_tokens"] != output_len:
            raise RuntimeError(f"asked for {output_len} tokens, got {usage}")

    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        list(pool.map(one, prompts))


def llamacpp_streams(server: LlamaServer, prompts: list[list[int]], output_len: int) -> None:
    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        replies = list(pool.map(lambda p: server.complete(p, output_len), prompts))
    if any(len(reply.token_ids) != output_len for reply in replies):
        raise RuntimeError(f"llama-server did not return {output_len} tokens for every stream")


def _mib(values: list[int]) -> str:
    return f"{statistics.median(values) / 1024:7.1f} MiB (runs: " + (
        ", ".join(f"{v / 1024:.1f}" for v in values) + ")"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-streams", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    add_llamacpp_args(parser)
    add_common_args(parser, default_model="smollm2")
    args = parser.parse_args()
    num_threads = args.num_threads or 2

    import torch

    from backend_engine.worker.model_runner import kv_bytes_per_block
    from model_files.checkpoint import Checkpoint

    model = checkpoint(args.model, args.size)
    model_config = Checkpoint(model).check()
    per_slot = args.prompt_len + args.output_len + 16
    num_blocks = args.num_streams * -(-per_slot // _BLOCK_SIZE)
    kv_bytes = {
        kv_dtype: num_blocks
        * kv_bytes_per_block(model_config, _BLOCK_SIZE, torch.float32, kv_dtype)
        for kv_dtype in ("auto", "int8")
    }
    rng = random.Random(0)
    vocab = model_config.vocab_size
    prompts = [
        [rng.randrange(10, vocab - 16) for _ in range(args.prompt_len)]
        for _ in range(args.num_streams)
    ]
    binary, gguf, fa_run = llamacpp_arm(args, model, shipped_gguf())
    fa = min(fa_run, default=None)  # off where it runs: memory hardly depends on it

    readings: dict[str, list[MemoryReading]] = {}
    commands: dict[str, str] = {}
    for _ in range(args.repeats):
        for label, (dequantize, kv_dtype) in ARMS.items():
            engine = our_engine(
                model, dequantize, kv_dtype, num_threads, kv_bytes[kv_dtype], args.num_streams
            )
            with engine as (process, client, command):
                streams = partial(our_streams, client, prompts, args.output_len)
                reading = measure(process.pid, streams)
                readings.setdefault(label, []).append(reading)
                commands[label] = " ".join(command).replace(sys.executable, "python")
        if binary is not None and gguf is not None and fa is not None:
            label = "llama.cpp llama-server"
            with LlamaServer(binary, gguf, args.num_streams, per_slot, fa, num_threads) as server:
                streams = partial(llamacpp_streams, server, prompts, args.output_len)
                reading = measure(server.pid, streams)
                readings.setdefault(label, []).append(reading)
                commands[label] = " ".join(server.command)

    print(f"command: {command_line()}")
    print(
        f"model: {model}; {args.num_streams} streams of {args.prompt_len} prompt + "
        f"{args.output_len} output tokens; threads: {num_threads}; repeats: {args.repeats}; "
        f"our KV budget {kv_bytes['auto'] / 2**20:.0f} MiB (float32) or "
        f"{kv_bytes['int8'] / 2**20:.0f} MiB (int8), llama.cpp -c "
        f"{args.num_streams * per_slot} (float16 KV)"
    )
    for label, values in readings.items():
        print(f"{label}:  {commands[label]}")
        rows = (
            ("after load", "VmRSS", [r.after_load_kib for r in values]),
            (f"at {args.num_streams} streams", "VmRSS", [r.at_streams_kib for r in values]),
            ("peak", "VmHWM", [r.peak_kib for r in values]),
        )
        for name, field, kib in rows:
            print(f"  {name + ':':16}{field} {_mib(kib)}")
    if binary is None or gguf is None:
        print(missing_binary_note() if binary is None else "llama.cpp arm skipped")
        return
    theirs = readings.get("llama.cpp llama-server")
    if theirs is None:
        return
    for label in ARMS:
        for name, pick in (("after load", 0), (f"at {args.num_streams} streams", 1)):
            ours_kib = statistics.median(_field(r, pick) for r in readings[label])
            their_kib = statistics.median(_field(r, pick) for r in theirs)
            print(f"ratio ({label} / llama.cpp), {name}: {ours_kib / their_kib:.2f}x")


def _field(reading: MemoryReading, pick: int) -> int:
    return reading.after_load_kib if pick == 0 else reading.at_streams_kib


if __name__ == "__main__":
    main()
