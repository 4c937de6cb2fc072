"""The `needle-hf` command line.

    needle-hf convert SRC OUT_DIR [--tokenizer tokenizer.model] [--dtype float32|bfloat16|float16]
                                  [--overwrite] [--verify-with auto|flax|torch]
    needle-hf export HF_DIR OUT.pkl [--dtype ...] [--overwrite] [--no-verify]
    needle-hf build HF_DIR OUT.cact [--bits 2|3|4] [--bits-map SPEC] [--lora PEFT_DIR|needle_lora.pkl]
                                    [--tokenizer tokenizer.model|blob.cact] [--no-tokenizer] [--overwrite]
    needle-hf lora import needle_lora.pkl OUT_DIR --base HF_DIR [--overwrite]
    needle-hf lora export PEFT_DIR OUT.pkl [--base HF_DIR] [--overwrite]
    needle-hf eval suites FOLDER [--suite NAME ...] [--module PATH_OR_DOTTED ...] [--min-confidence X]
                                 [--report OUT.md|OUT.json] (see needle_hf.evaluation.command)
    needle-hf playground FOLDER [FOLDER ...] [--host 127.0.0.1] [--port 7860] [--framework pt|flax]
                                             [--write-space OUT_DIR [--overwrite]]

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
from needle_hf.evaluation import command as evaluation_command


def printable(text: str) -> str:
    """`text` with any character the output encoding cannot hold escaped: a path from the command line
    may carry undecodable bytes (as lone surrogates), which a strict stream would refuse to print."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _progress(command: str) -> Callable[[str], None]:
    """A printer of progress lines on stderr, each with the seconds since the command started."""
    started = time.perf_counter()

    def report(line: str):
        print(printable(f"needle-hf {command} [{time.perf_counter() - started:6.1f} s] {line}"), file=sys.stderr, flush=True)

    return report


def _add_convert_arguments(parser: argparse.ArgumentParser):
    parser.add_argument("source", metavar="SRC", help="a native checkpoint (.pkl), a .cact blob or a Needle 3 .safetensors checkpoint (recognised by content)")
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
    print(printable(result.summary()), flush=True)
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
    print(printable(result.summary()), flush=True)
    return 0


def _add_build_arguments(parser: argparse.ArgumentParser):
    parser.add_argument("hf_dir", metavar="HF_DIR", help="a saved Hugging Face Needle folder")
    parser.add_argument("out_path", metavar="OUT.cact", help="the deployment blob to write")
    parser.add_argument("--bits", type=int, help="CQ width of every quantized matrix: 2, 3 or 4 (default: the "
                                                 "config's weight_bits map if it has one, else 4)")
    parser.add_argument("--bits-map", metavar="SPEC",
                        help='per-tensor widths, e.g. "attn.q_proj=3,engram=2,default=4" (1.58 = ternary)')
    parser.add_argument("--lora", metavar="PEFT_DIR", help="a PEFT LoRA adapter folder (or the reference's needle_lora.pkl) to merge before quantizing")
    parser.add_argument("--tokenizer", metavar="TOKENIZER",
                        help="SentencePiece tokenizer.model, or a .cact whose tokenizer to embed (default: "
                             "HF_DIR/tokenizer.model, else HF_DIR/tokenizer.json)")
    parser.add_argument("--no-tokenizer", dest="embed_tokenizer", action="store_false",
                        help="write the blob without the tokenizer record")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing OUT.cact")


def _run_build(args: argparse.Namespace) -> int:
    from needle_hf.conversion.build import build_cact

    result = build_cact(args.hf_dir, args.out_path, bits=args.bits, bits_map=args.bits_map, lora=args.lora,
                        tokenizer=args.tokenizer, embed_tokenizer=args.embed_tokenizer, overwrite=args.overwrite,
                        progress=_progress("build"))
    print(printable(result.summary()), flush=True)
    return 0


def _add_lora_arguments(parser: argparse.ArgumentParser):
    actions = parser.add_subparsers(dest="lora_action", metavar="ACTION", required=True)
    to_peft = actions.add_parser("import", help="the reference's needle_lora.pkl -> a PEFT adapter folder")
    to_peft.add_argument("adapter", metavar="needle_lora.pkl", help="the reference's LoRA adapter")
    to_peft.add_argument("out_dir", metavar="OUT_DIR", help="the PEFT adapter folder to create")
    to_peft.add_argument("--base", metavar="HF_DIR", required=True, help="the HF Needle folder the adapter is for")
    to_peft.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT_DIR")
    to_peft.set_defaults(lora_run=_run_lora_import)
    to_native = actions.add_parser("export", help="a PEFT adapter folder -> the reference's adapter pickle")
    to_native.add_argument("peft_dir", metavar="PEFT_DIR", help="a PEFT LoRA adapter folder")
    to_native.add_argument("out_path", metavar="OUT.pkl", help="the reference-format adapter to write")
    to_native.add_argument("--base", metavar="HF_DIR",
                           help="the HF Needle folder the adapter is for (default: the adapter's "
                                "base_model_name_or_path, when that is a local folder)")
    to_native.add_argument("--overwrite", action="store_true", help="replace an existing OUT.pkl")
    to_native.set_defaults(lora_run=_run_lora_export)


def _run_lora(args: argparse.Namespace) -> int:
    return args.lora_run(args)


def _run_lora_import(args: argparse.Namespace) -> int:
    from needle_hf.conversion.lora import import_native_adapter

    out_dir, adapter = import_native_adapter(args.adapter, args.out_dir, base=args.base, overwrite=args.overwrite)
    print(printable(f"wrote {out_dir}: rank-{adapter.rank} LoRA on {', '.join(adapter.pairs)}, scale {adapter.scale:g}"),
          flush=True)
    return 0


def _run_lora_export(args: argparse.Namespace) -> int:
    from needle_hf.conversion.lora import export_peft_adapter

    out_path, adapter = export_peft_adapter(args.peft_dir, args.out_path, base=args.base, overwrite=args.overwrite)
    print(printable(f"wrote {out_path}: rank-{adapter.rank} LoRA on {', '.join(adapter.pairs)}, scale {adapter.scale:g}"),
          flush=True)
    return 0


def _add_playground_arguments(parser: argparse.ArgumentParser):
    parser.add_argument("folders", metavar="FOLDER", nargs="+",
                        help="converted Needle folders or Hub ids, each loaded at its first Run; the page switches between them")
    parser.add_argument("--host", default="127.0.0.1", help="the address to serve on (default: 127.0.0.1, this machine only)")
    parser.add_argument("--port", type=int, default=7860, help="the port to serve on (default: 7860)")
    parser.add_argument("--framework", choices=("pt", "flax"), help="the twin to run (default: pt)")
    parser.add_argument("--write-space", metavar="OUT_DIR",
                        help="instead of serving, write a Hugging Face Space (app.py, requirements.txt, README.md) "
                             "that serves the page on FOLDER (one Hub id)")
    parser.add_argument("--overwrite", action="store_true", help="with --write-space: replace a non-empty OUT_DIR")


def _run_playground(args: argparse.Namespace) -> int:
    if args.write_space:
        from needle_hf.playground.space import write_space

        if len(args.folders) != 1:
            raise ValueError(f"--write-space: a Space serves one model, got {len(args.folders)} FOLDERs")
        out_dir = write_space(args.write_space, args.folders[0], framework=args.framework, overwrite=args.overwrite)
        print(printable(f"wrote {out_dir}: a Gradio Space serving {args.folders[0]} (app.py, requirements.txt, README.md)"),
              flush=True)
        return 0
    from needle_hf.playground.app import build_app, launch

    app = build_app(args.folders, framework=args.framework)
    print(printable(f"needle-hf playground: serving {', '.join(args.folders)} on http://{args.host}:{args.port}"),
          file=sys.stderr, flush=True)
    launch(app, host=args.host, port=args.port)
    return 0


# name -> (help, add arguments, run)
COMMANDS = {
    "convert": ("convert a native .pkl or a .cact into a Hugging Face folder", _add_convert_arguments, _run_convert),
    "export": ("convert a Hugging Face Needle folder back into a native .pkl", _add_export_arguments, _run_export),
    "build": ("quantize a Hugging Face Needle folder (and a LoRA adapter) into a .cact for the engine",
              _add_build_arguments, _run_build),
    "lora": ("convert LoRA adapters between the reference's .pkl and PEFT", _add_lora_arguments, _run_lora),
    "push": ("push a Hugging Face Needle folder to the Hub (model card included)", hub.add_push_arguments, hub.run_push),
    "eval": ("run acceptance suites against a Hugging Face Needle folder", evaluation_command.add_eval_arguments,
             evaluation_command.run_eval),
    "playground": ("serve a web page to try Needle folders with your tools (Gradio, 127.0.0.1)",
                   _add_playground_arguments, _run_playground),
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
    return printable(f"needle-hf {command}: error: {text}")


def _check_no_nul(args: argparse.Namespace):
    """A NUL byte cannot be in a path; name the argument instead of the system's bare "embedded null byte"."""
    for name, value in vars(args).items():
        if isinstance(value, str) and "\0" in value:
            raise ValueError(f"argument {name.upper()} {value!r} holds a NUL byte, which no path can hold")


def main(argv: Sequence[str] | None = None) -> int:
    """Run one subcommand; returns the exit status (argparse exits with 2 on a usage error)."""
    args = build_parser().parse_args(argv)
    try:
        _check_no_nul(args)
        return args.run(args)
    except INPUT_ERRORS as error:
        print(error_line(args.command, error), file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
