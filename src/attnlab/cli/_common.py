"""Helpers shared by the subcommands: errors, output folders, tables."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from attnlab._io import atomic_write  # noqa: F401  (re-exported for the subcommands)
from attnlab.trace import format_table  # noqa: F401  (re-exported for the subcommands)


class CLIError(Exception):
    """A user error: printed as one line on stderr, exit code 2, no traceback."""


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr (exit code 2), not usage + error.

    Subparsers made with ``add_subparsers().add_parser`` inherit this class.
    """

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def prepare_out_dir(path: str | os.PathLike) -> Path:
    """Create ``path`` if needed and check it is writable, else raise ``CLIError``."""
    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".attnlab-write-test-"):
            pass
    except OSError as exc:
        raise CLIError(f"cannot write to output folder {str(out)!r}: {exc.strerror or exc}") from None
    return out


def use_color(stream=None) -> bool:
    stream = stream or sys.stdout
    return stream.isatty() and os.environ.get("NO_COLOR") is None and os.environ.get("TERM") != "dumb"


def add_quantized_flags(p, *, what: str) -> None:
    """``--quantized`` and ``--activations`` (``generate``, ``sweep``); ``what`` names the
    option that gives the model file, for the help."""
    p.add_argument("--quantized", action="store_true",
                   help=f"keep a .gguf file's Q8_0/Q4_0/Q4_1 weights quantized (without {what}: the bundled "
                   "SmolLM2 too): about 5x fewer bytes read per token, faster decoding, logits within about "
                   "1e-2 of the float32 default")
    p.add_argument("--activations", choices=("float32", "int8"), default="float32",
                   help="with --quantized: what the quantized weights multiply. float32 (default): each "
                   "layer's input as it is. int8: rounded to int8 per block of 32 values, as llama.cpp "
                   "does; its 4-bit products become integer dot products (decoding about 1.2-1.3x faster "
                   "on a CPU with AVX2 or AVX512-VNNI), and the next-token distribution moves (SmolLM2: a KL "
                   "divergence of about 0.006 a token, as far as llama.cpp's from the exact products)")


def check_quantized_flags(args, path: Path | None, *, what: str) -> None:
    """The errors of :func:`add_quantized_flags`' options that need no model loaded."""
    if args.quantized and path is not None and path.suffix.lower() != ".gguf":
        raise CLIError(f"--quantized needs a .gguf file (or no {what}: the bundled SmolLM2), got {path}")
    if args.activations != "float32" and not args.quantized:
        raise CLIError(f"--activations {args.activations} needs --quantized (the products it rounds the inputs of)")


def load_decoder(path: Path | None, *, quantized: bool, activations: str):
    """The model at ``path`` (None: the bundled SmolLM2), its ``.gguf`` weights kept quantized
    where ``quantized``, multiplying ``activations`` (``"int8"``: rounded, see
    :func:`attnlab.quant.quantize_activations`)."""
    if path is None:
        from attnlab.models.llama import load_smollm2

        model = load_smollm2(quantized=quantized)
    else:
        from attnlab.models.registry import from_pretrained

        model = from_pretrained(path, **({"quantized": True} if quantized else {}))
    if activations == "int8":
        from attnlab.quant import is_quantized, keeps_quantized, quantize_activations

        if keeps_quantized():  # else the weights were dequantized: nothing to round for
            if not any(is_quantized(p.data) for _, p in model.named_parameters()):
                raise CLIError(f"--activations int8: {path or 'the model'} has no Q8_0, Q4_0 or Q4_1 weights "
                               "to round the inputs of (its weights are float)")
            quantize_activations(model)
    return model
