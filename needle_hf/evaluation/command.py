"""`needle-hf eval suites FOLDER`: acceptance suites on a Needle folder, from the command line.

    needle-hf eval suites FOLDER [--suite NAME ...] [--module PATH_OR_DOTTED ...] [--min-confidence X]
                                 [--max-new-tokens N] [--framework pt|flax] [--report OUT.md|OUT.json] [--overwrite]

Without ``--suite`` or ``--module`` every suite of an installed cactus-needle runs; ``--module`` alone
runs just those modules; ``--suite`` picks by name among both. Progress bars go to stderr, the summary
table to stdout. Exit status: 0 when every suite passes, 3 when one fails (1: bad input, 2: usage).
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

#: The exit status of a run whose suites did not all pass (1 is bad input, 2 a usage error).
SUITE_FAILED = 3


def add_eval_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="eval_action", metavar="ACTION", required=True)
    summary = "run acceptance suites (the reference's format) against a Needle folder"
    suites = actions.add_parser("suites", help=summary, description=summary[0].upper() + summary[1:] + ": the "
                                "cases are asked one by one, scored, and the pass rates printed as a table.",
                                epilog="Exit status: 0 when every suite passes, 3 when one fails, 1 for bad input.")
    suites.add_argument("folder", metavar="FOLDER", help="a Hugging Face Needle folder")
    suites.add_argument("--suite", dest="suites", metavar="NAME", action="append", default=[],
                        help="run this suite (repeatable; default: all found)")
    suites.add_argument("--module", dest="modules", metavar="PATH_OR_DOTTED", action="append", default=[],
                        help="a suite module of your own: a .py file or a dotted module name with TOOLS, SYSTEM "
                             "and TEST_CASES (repeatable)")
    suites.add_argument("--min-confidence", type=float, default=0.0, metavar="X",
                        help="act on calls only at or above this confidence (default 0: score raw output)")
    suites.add_argument("--max-new-tokens", type=int, default=None, metavar="N",
                        help="answer length cap (default: needle_hf.Needle's)")
    suites.add_argument("--framework", choices=("pt", "flax"), default=None, help="the twin to run (default pt)")
    suites.add_argument("--report", metavar="OUT.md|OUT.json",
                        help="write the report (Markdown or JSON) and a pass-rate plot beside it (.png)")
    suites.add_argument("--overwrite", action="store_true", help="replace an existing report and plot")
    suites.set_defaults(eval_run=run_eval_suites)


def run_eval(args: argparse.Namespace) -> int:
    return args.eval_run(args)


def _select(args: argparse.Namespace) -> list:
    from .suites import NO_REFERENCE_SUITES, find_suites, load_suite

    modules = {}
    for target in args.modules:
        suite = load_suite(target)
        modules[suite.name] = suite
    if args.modules and not args.suites:
        return list(modules.values())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # said below, as an error, when it matters
        found = find_suites()
    available = {**found, **modules}
    if not args.suites:
        if not found:
            raise ValueError(NO_REFERENCE_SUITES)
        return list(found.values())
    unknown = [name for name in args.suites if name not in available]
    if unknown:
        known = ", ".join(sorted(available)) or "none (" + NO_REFERENCE_SUITES + ")"
        raise ValueError(f"--suite {', '.join(unknown)}: no such suite; known suites: {known}")
    return [available[name] for name in dict.fromkeys(args.suites)]


def run_eval_suites(args: argparse.Namespace) -> int:
    from .report import check_report_path, write_report
    from .runner import run_suites

    folder = Path(args.folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"FOLDER {args.folder}: no such folder (expected a Hugging Face Needle folder)")
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"FOLDER {args.folder}: no config.json (expected a Hugging Face Needle folder)")
    if not 0.0 <= args.min_confidence <= 1.0:
        raise ValueError(f"--min-confidence: expected a number in [0, 1], got {args.min_confidence}")
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens: expected a positive number, got {args.max_new_tokens}")
    if args.report:
        try:  # before the run: a report that cannot be written should not cost a run
            check_report_path(args.report, overwrite=args.overwrite)
        except ImportError as error:
            raise ValueError(str(error)) from None
    suites = _select(args)
    result = run_suites(suites, args.folder, min_confidence=args.min_confidence, max_new_tokens=args.max_new_tokens,
                        framework=args.framework)
    print(result.table())
    passing = sum(suite.passes for suite in result.suites)
    gate = f", confidence gate {args.min_confidence:g}" if args.min_confidence else ""
    print(f"{passing}/{len(result.suites)} suites pass ({result.seconds:.1f} s{gate})", flush=True)
    if args.report:
        report, plot = write_report(result, args.report, overwrite=args.overwrite)
        print(f"wrote {report} and {plot}", file=sys.stderr, flush=True)
    return 0 if result.passes else SUITE_FAILED


__all__ = ["SUITE_FAILED", "add_eval_arguments", "run_eval", "run_eval_suites"]
