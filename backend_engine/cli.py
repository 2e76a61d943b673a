"""Engine subcommands of the ``tollway`` CLI: ``demo-model``, ``convert`` and ``engine``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def register_engine_commands(app: typer.Typer) -> None:
    app.command("demo-model")(demo_model)
    app.command("convert")(convert)
    app.command("engine")(engine)


def demo_model(
    directory: Annotated[Path, typer.Argument(help="Where to write the checkpoint.")],
    size: Annotated[str, typer.Option(help="small or large")] = "small",
    seed: Annotated[int, typer.Option(help="Seed for the random weights.")] = 0,
) -> None:
    """Write a random-weight Llama checkpoint in exact Hugging Face format."""
    from backend_engine.demo_model import DEMO_SIZES, write_demo_checkpoint

    if size not in DEMO_SIZES:
        raise typer.BadParameter(
            f"size must be one of {', '.join(DEMO_SIZES)}", param_hint="--size"
        )
    path = write_demo_checkpoint(directory, size=size, seed=seed, show_progress=True)
    typer.echo(f"wrote {size} demo checkpoint to {path}")


def convert(
    source: Annotated[Path, typer.Argument(help="The GGUF file to convert.")],
    out_dir: Annotated[Path, typer.Argument(help="The Hugging Face directory to write.")],
    dtype: Annotated[str, typer.Option(help="float32, bfloat16 or float16")] = "float32",
    force: Annotated[bool, typer.Option(help="Write into a directory that holds files.")] = False,
) -> None:
    """Convert a GGUF file into a Hugging Face checkpoint directory (weights dequantized)."""
    from backend_engine.gguf_convert import convert_gguf

    try:
        convert_gguf(source, out_dir, dtype=dtype, overwrite=force, show_progress=True)
    except (ValueError, OSError) as exc:  # GGUFError is a ValueError
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=1) from None
    typer.echo(f"wrote {out_dir} from {source} ({dtype})")


def engine(
    model: Annotated[
        str, typer.Option(help="A Hugging Face checkpoint directory or a .gguf file.")
    ],
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8100,
    uds: Annotated[str | None, typer.Option(help="Listen on this Unix socket instead.")] = None,
    served_model_name: Annotated[str | None, typer.Option(help="Model id in the API.")] = None,
    device: Annotated[str, typer.Option(help="cpu or cuda")] = "cpu",
    dtype: Annotated[str, typer.Option(help="auto, float32, bfloat16 or float16")] = "auto",
    block_size: Annotated[int, typer.Option(help="Tokens per KV block.")] = 16,
    kv_cache_memory_bytes: Annotated[int, typer.Option(help="KV cache budget.")] = 512 << 20,
    max_num_seqs: Annotated[int, typer.Option(help="Most sequences per step.")] = 64,
    max_num_batched_tokens: Annotated[int, typer.Option(help="Token budget per step.")] = 2048,
    enable_prefix_caching: Annotated[bool, typer.Option(help="Reuse shared prefixes.")] = True,
) -> None:
    """Serve one checkpoint over an OpenAI-compatible HTTP API."""
    from backend_engine.config import EngineConfig
    from backend_engine.server.app import serve

    try:
        config = EngineConfig(
            model=model,
            device=device,
            dtype=dtype,
            block_size=block_size,
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_prefix_caching=enable_prefix_caching,
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    try:
        serve(config, host=host, port=port, uds=uds, model_name=served_model_name)
    except (FileNotFoundError, ValueError) as exc:  # a bad checkpoint or setting
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=1) from exc
