"""The `needle-hf` command line.

    needle-hf convert SRC OUT_DIR [--tokenizer tokenizer.model] [--dtype float32|bfloat16|float16]
                                  [--overwrite] [--verify-with auto|flax|torch]
    needle-hf export HF_DIR OUT.pkl [--dtype ...] [--overwrite] [--no-verify]

Progress goes to stderr, the one-line summary to stdout. A problem with the input (a malformed or
unsafe file, a key or shape mismatch, an existing output) prints `needle-hf <command>: error: ...`
on stderr and exits with status 1; usage errors exit with status 2.

Each subcommand is one entry of `COMMANDS`: a function that adds its arguments and one that runs
it. Later subcommands (`push`) and flags that act on a finished conversion (`convert --push`, which
would hand `ConversionResult.out_dir` to the push code) plug in there.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Callable, Sequence

from needle_hf.conversion.convert import convert
from needle_hf.conversion.export import OUTPUT_DTYPES, export_native
from needle_hf.conversion.verification import VERIFY_BACKENDS
from needle_hf import hub


def _progress(command: str) -> Callable[[str], None]:
    """A printer of progress lines on stderr, each with the seconds since the command started."""
    started = time.perf_counter()

    def report(line: str):
        print(f"needle-hf {command} [{time.perf_counter() - started:6.1f} s] {line}", file=sys.stderr, flush=True)

    return report


def _add_convert_arguments(parser: argparse.ArgumentParser):
    parser.add_argument("source", metavar="SRC", help="a native checkpoint (.pkl) or a .cact blob (recognised by content)")
    parser.add_argument("out_dir", metavar="OUT_DIR", help="the Hugging Face folder to create")
    parser.add_argument("--tokenizer", metavar="TOKENIZER_MODEL",
                        help="SentencePiece tokenizer.model (default: the tokenizer embedded in a .cact)")
    parser.add_argument("--dtype", choices=OUTPUT_DTYPES,
                        help="weight dtype of model.safetensors (default: the source's; float32 for a .cact)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace a non-empty OUT_DIR (only once the new folder is complete)")
    parser.add_argument("--verify-with", choices=VERIFY_BACKENDS,
                        help="also check that this HF model, loaded from OUT_DIR, reproduces the source's logits "
                             "(auto: Flax when installed, else PyTorch). Without it, the written tensors are "
                             "still read back and compared bit for bit")
    hub.add_convert_push_arguments(parser)


def _run_convert(args: argparse.Namespace) -> int:
    result = convert(
        args.source,
        args.out_dir,
        tokenizer=args.tokenizer,
        dtype=args.dtype,
        overwrite=args.overwrite,
        verify_with=args.verify_with,
        progress=_progress("convert"),
    )
    print(result.summary(), flush=True)
    hub.push_converted_folder(args, result.out_dir)
    return 0


def _add_export_arguments(parser: argparse.ArgumentParser):
    parser.add_argument("hf_dir", metavar="HF_DIR", help="a saved Hugging Face Needle folder")
    parser.add_argument("out_path", metavar="OUT.pkl", help="the native format_version 2 checkpoint to write")
    parser.add_argument("--dtype", choices=OUTPUT_DTYPES, help="cast the weights (default: keep the stored dtypes)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing OUT.pkl")
    parser.add_argument("--no-verify", dest="verify", action="store_false",
                        help="skip reading the written checkpoint back")


def _run_export(args: argparse.Namespace) -> int:
    result = export_native(
        args.hf_dir,
        args.out_path,
        dtype=args.dtype,
        overwrite=args.overwrite,
        verify=args.verify,
        progress=_progress("export"),
    )
    print(result.summary(), flush=True)
    return 0


# name -> (help, add arguments, run)
COMMANDS = {
    "convert": ("convert a native .pkl or a .cact into a Hugging Face folder", _add_convert_arguments, _run_convert),
    "export": ("convert a Hugging Face Needle folder back into a native .pkl", _add_export_arguments, _run_export),
    "push": ("push a Hugging Face Needle folder to the Hub (model card included)", hub.add_push_arguments, hub.run_push),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="needle-hf", description="Needle 2 checkpoints for Hugging Face Transformers.")
    subcommands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (summary, add_arguments, run) in COMMANDS.items():
        sub = subcommands.add_parser(name, help=summary, description=summary)
        add_arguments(sub)
        sub.set_defaults(run=run)
    return parser


# What a subcommand raises for bad input or an unreachable service: every reader, converter and
# the push report bad input as a ValueError subclass whose message names the file, tensor or field;
# OSError covers missing files and permissions; RecursionError and MemoryError are last-resort
# guards (the readers bound nesting and allocation themselves). Anything else is a bug and keeps
# its traceback.
INPUT_ERRORS = (ValueError, OSError, RecursionError, MemoryError)
MAX_ERROR_CHARS = 2000


def error_line(command: str, error: BaseException) -> str:
    """The one line printed for a failed subcommand."""
    text = " ".join(str(error).split()) or type(error).__name__
    if isinstance(error, (RecursionError, MemoryError)):
        text = f"{type(error).__name__}: the input is nested too deeply or too large ({text})"
    if len(text) > MAX_ERROR_CHARS:
        text = text[:MAX_ERROR_CHARS] + "..."
    return f"needle-hf {command}: error: {text}"


def main(argv: Sequence[str] | None = None) -> int:
    """Run one subcommand; returns the exit status (argparse exits with 2 on a usage error)."""
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except INPUT_ERRORS as error:
        print(error_line(args.command, error), file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
