"""The engine's command line: ``python -m backend_engine`` serves one checkpoint.

``tollway engine``, ``tollway demo-model`` and ``tollway convert`` run the commands of `app`
(the gateway's CLI hands them over without importing this module until one is run). The
engine never imports the gateway.

The ``engine`` command's flags are generated from `EngineConfig`'s fields: one flag per
field (``kv_cache_memory_bytes`` -> ``--kv-cache-memory-bytes``), with the field's default
and the help in its metadata, so a setting, its default and its flag cannot drift apart.
Only where the server listens (``--host``/``--port``/``--uds``/``--served-model-name``) is
the command's own.
"""

from __future__ import annotations

import dataclasses
import inspect
import types
import typing
from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Union

import typer

from backend_engine.config import HELP, QUANTIZATION_CALIBRATIONS, EngineConfig

if TYPE_CHECKING:
    import torch

ENGINE_INSTALL_COMMAND = "pip install 'tollway[engine]'"
_ENGINE_DEPENDENCIES = ("torch", "triton", "safetensors")

_SERVER_OPTIONS: tuple[inspect.Parameter, ...] = tuple(
    inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation, default=default)
    for name, annotation, default in (
        ("host", Annotated[str, typer.Option(help="Address to listen on.")], "127.0.0.1"),
        ("port", Annotated[int, typer.Option(help="TCP port.")], 8100),
        (
            "uds",
            Annotated[str | None, typer.Option(help="Listen on this Unix socket instead.")],
            None,
        ),
        (
            "served_model_name",
            Annotated[str | None, typer.Option(help="Model id in the API.")],
            None,
        ),
    )
)


def engine_config_options(config_type: type[Any] = EngineConfig) -> tuple[inspect.Parameter, ...]:
    """One keyword parameter per field of ``config_type``, in field order, as typer reads them:
    the field's type and default, and the help in its metadata (a field without is an error)."""
    hints = typing.get_type_hints(config_type)
    options = []
    for config_field in dataclasses.fields(config_type):
        help_text = config_field.metadata.get(HELP)
        if not help_text:
            raise TypeError(
                f"{config_type.__name__}.{config_field.name} has no {HELP!r} in its metadata, "
                "so it cannot be an engine flag"
            )
        annotation = _option_annotation(hints[config_field.name], help_text)
        default: Any = config_field.default
        if default is dataclasses.MISSING:
            default = inspect.Parameter.empty  # a required option (--model)
        options.append(
            inspect.Parameter(
                config_field.name,
                inspect.Parameter.KEYWORD_ONLY,
                annotation=annotation,
                default=default,
            )
        )
    return tuple(options)


def _option_annotation(hint: Any, help_text: str) -> Any:
    if typing.get_origin(hint) in (Union, types.UnionType):  # X | None
        (value_type,) = (arg for arg in typing.get_args(hint) if arg is not type(None))
        return Annotated[value_type | None, typer.Option(help=help_text)]
    return Annotated[hint, typer.Option(help=help_text)]


def engine(**options: Any) -> None:
    """Serve one checkpoint over an OpenAI-compatible HTTP API."""
    server_options = {parameter.name: options.pop(parameter.name) for parameter in _SERVER_OPTIONS}
    try:
        config = EngineConfig(**options)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    try:
        run_server(
            config,
            host=server_options["host"],
            port=server_options["port"],
            uds=server_options["uds"],
            model_name=server_options["served_model_name"],
        )
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.partition(".")[0] not in _ENGINE_DEPENDENCIES:
            raise
        typer.echo(f"error: {exc.name} is not installed: {ENGINE_INSTALL_COMMAND}", err=True)
        raise typer.Exit(code=1) from exc
    except (FileNotFoundError, ValueError) as exc:  # a bad checkpoint or setting
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=1) from exc


_CONFIG_OPTIONS = engine_config_options()
engine.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
    [_CONFIG_OPTIONS[0], *_SERVER_OPTIONS, *_CONFIG_OPTIONS[1:]]  # --model first
)


def run_server(
    config: EngineConfig, *, host: str, port: int, uds: str | None, model_name: str | None
) -> None:
    """Load the model and serve it until SIGINT or SIGTERM."""
    # The model's runner needs torch: imported first, so a missing torch is said before the
    # checkpoint is read.
    from backend_engine.server.app import serve
    from backend_engine.worker.model_runner import plan_model_runner

    serve(
        config, host=host, port=port, uds=uds, model_name=model_name, plan_runner=plan_model_runner
    )


def demo_model(
    directory: Annotated[Path, typer.Argument(help="Where to write the checkpoint.")],
    size: Annotated[str, typer.Option(help="small or large")] = "small",
    seed: Annotated[int, typer.Option(help="Seed for the random weights.")] = 0,
) -> None:
    """Write a random-weight Llama checkpoint in exact Hugging Face format."""
    from backend_engine.demo.checkpoint import write_demo_checkpoint
    from backend_engine.demo.checkpoint_files import DEMO_SIZES

    if size not in DEMO_SIZES:
        raise typer.BadParameter(
            f"size must be one of {', '.join(DEMO_SIZES)}", param_hint="--size"
        )
    path = write_demo_checkpoint(directory, size=size, seed=seed, show_progress=True)
    typer.echo(f"wrote {size} demo checkpoint to {path}")


def convert(
    source: Annotated[
        Path,
        typer.Argument(help="A GGUF file, or a Hugging Face directory (OUT a .gguf file)."),
    ],
    out: Annotated[
        Path,
        typer.Argument(help="The Hugging Face directory to write, or a .gguf file."),
    ],
    dtype: Annotated[str, typer.Option(help="float32, bfloat16 or float16")] = "float32",
    quantization: Annotated[
        str | None,
        typer.Option(help="A .gguf OUT only: int8 (Q8_0 blocks) or int4 (Q4_1 blocks)."),
    ] = None,
    group_size: Annotated[
        int | None, typer.Option(help="With --quantization int4: values per scale, 32 or 64.")
    ] = None,
    calibration: Annotated[
        str,
        typer.Option(
            help="With --quantization int4: gptq (calibrated on text that ships with Python) "
            "or rtn (round to nearest)."
        ),
    ] = "gptq",
    force: Annotated[bool, typer.Option(help="Write over OUT's files.")] = False,
) -> None:
    """Convert a GGUF file into a Hugging Face directory (weights dequantized), or a GGUF
    file or a Hugging Face directory into a GGUF file (float or quantized)."""
    from backend_engine.model_loader.gguf_convert import convert_gguf
    from backend_engine.model_loader.gguf_export import convert_to_gguf

    try:
        if group_size is not None and quantization != "int4":
            raise ValueError("--group-size goes with --quantization int4")
        if calibration not in QUANTIZATION_CALIBRATIONS:
            raise ValueError(
                f"--calibration must be one of {', '.join(QUANTIZATION_CALIBRATIONS)}, "
                f"got {calibration!r}"
            )
        if out.suffix.lower() == ".gguf":
            convert_to_gguf(
                source,
                out,
                dtype=dtype,
                quantization=quantization,
                group_size=group_size or 32,
                overwrite=force,
                show_progress=True,
                calibrate=partial(_gptq_hessians, source) if calibration == "gptq" else None,
            )
        elif quantization is not None:
            raise ValueError("--quantization writes a GGUF file: OUT must end in .gguf")
        elif source.is_dir():
            raise ValueError(
                f"{source} is a Hugging Face directory: it can be converted to a .gguf file"
            )
        else:
            convert_gguf(source, out, dtype=dtype, overwrite=force, show_progress=True)
    except (ValueError, OSError) as exc:  # GGUFError is a ValueError
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=1) from None
    what = dtype if quantization is None else quantization
    if quantization == "int4":
        what += f", groups of {group_size or 32}, {calibration}"
    typer.echo(f"wrote {out} from {source} ({what})")


def _gptq_hessians(source: Path) -> Mapping[str, torch.Tensor]:
    from backend_engine.models import gptq_hessians
    from model_files.checkpoint import Checkpoint

    checkpoint = Checkpoint(source)
    return gptq_hessians(checkpoint, checkpoint.check(), "cpu", show_progress=True)


def register_engine_commands(app: typer.Typer) -> None:
    app.command("demo-model")(demo_model)
    app.command("convert")(convert)
    app.command("engine")(engine)


# `tollway demo-model|convert|engine ...` (through the gateway's CLI).
app = typer.Typer(name="tollway", add_completion=False, no_args_is_help=True)
register_engine_commands(app)

# `python -m backend_engine --model ...`: the engine command alone.
engine_app = typer.Typer(add_completion=False)
engine_app.command()(engine)
