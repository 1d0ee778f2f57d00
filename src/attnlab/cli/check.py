"""attnlab check FILE.py: check your solutions of the course's exercises.

FILE.py defines one or more of the exercises' functions, by their names (softmax,
scaled_dot_product_attention, causal_mask, ...; --list shows them all, with what each is
about). Each one found runs the exercise's random cases against attnlab's reference; the
first that fails is explained (the case, the shapes, the largest error and where, and the
mistake when it is a typical one). Then the attention-shaped ones go into SmolLM2 (the
bundled model), which is asked "What is the capital of France?": does it still answer
Paris, and how far did its logits move? Python's help(attnlab.exercises.task("softmax"))
states each task.

Exit status: 0 when every function found passed, 1 when one did not, 2 for a usage error
(no such file, a file that does not load or defines none of the functions).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from attnlab.cli._common import CLIError


def register(sub) -> None:
    p = sub.add_parser(
        "check",
        help="check your solutions of the course's exercises (and plug them into SmolLM2)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
        "  attnlab check my_attention.py\n"
        "  attnlab check my_attention.py --exercise softmax --no-model\n"
        "  attnlab check --list",
    )
    p.add_argument("file", metavar="FILE.py", nargs="?", default=None, help="the Python file with your functions")
    p.add_argument("--exercise", metavar="NAME", action="append", default=None,
                   help="check only this exercise (repeat for more; default: every one FILE.py defines)")
    p.add_argument("--no-model", action="store_true", help="skip SmolLM2: the random cases only")
    p.add_argument("--seed", type=int, default=0, metavar="N", help="seed of the random cases (default 0)")
    p.add_argument("--list", action="store_true", help="list the exercises and stop")
    p.set_defaults(run=run)


def _load(path: Path):
    """The learner's file as a module (its folder on sys.path while it loads); a file that
    does not load is a CLIError naming the file and line."""
    import importlib.util
    import traceback

    from attnlab.io.files import CheckpointError, regular_file

    try:
        regular_file(path, "Python file")
    except FileNotFoundError:
        raise CLIError(f"{path} is missing") from None
    except (CheckpointError, OSError) as exc:
        raise CLIError(str(exc)) from None
    spec = importlib.util.spec_from_file_location("attnlab_check_" + re.sub(r"\W", "_", path.stem), path)
    if spec is None or spec.loader is None:
        raise CLIError(f"{path} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.resolve().parent))
    try:
        spec.loader.exec_module(module)
    except SyntaxError as exc:
        raise CLIError(f"{path}, line {exc.lineno}: SyntaxError: {exc.msg}") from None
    except SystemExit as exc:  # sys.exit() at the top level of the file: put it under `if __name__ == "__main__":`
        code = "" if exc.code is None else repr(exc.code)
        raise CLIError(f"{path} called sys.exit({code}) while loading; put the code that runs it under "
                       "`if __name__ == \"__main__\":`") from None
    except Exception as exc:
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if Path(f.filename) == path.resolve()
                  or Path(f.filename) == path]
        where = f", line {frames[-1].lineno}" if frames else ""
        raise CLIError(f"{path}{where} raised {type(exc).__name__} while loading: {exc}") from None
    finally:
        sys.path.remove(str(path.resolve().parent))
    return module


def _list() -> int:
    from attnlab.exercises import names, task
    from attnlab.exercises._catalog import EXERCISES

    width = max(len(n) for n in names())
    for n in names():
        first = task(n).__doc__.strip().splitlines()[0]
        print(f"{n.ljust(width)}  {first}  (course: {EXERCISES[n].page})")
    return 0


def run(args) -> int:
    from attnlab.exercises import check, names

    if args.list:
        return _list()
    if args.file is None:
        raise CLIError("give FILE.py, the file with your functions (or --list to see the exercises)")
    if args.seed < 0:
        raise CLIError(f"--seed must be a non-negative integer, got {args.seed}")
    wanted = names()
    if args.exercise:
        unknown = [n for n in args.exercise if n not in wanted]
        if unknown:
            raise CLIError(f"--exercise: no exercise {unknown[0]!r}; the exercises are {', '.join(wanted)}")
        wanted = [n for n in wanted if n in args.exercise]
    path = Path(args.file)
    module = _load(path)
    found = [n for n in wanted if callable(getattr(module, n, None))]
    not_functions = [n for n in wanted if hasattr(module, n) and n not in found]
    if not_functions:
        n = not_functions[0]
        raise CLIError(f"{path}: {n} is not a function (a value of type {type(getattr(module, n)).__name__}); "
                       f"define `def {n}(...)`")
    if not found:
        if args.exercise:
            raise CLIError(f"{path} does not define {', '.join(wanted)}")
        raise CLIError(f"{path} defines none of the exercises' functions; define one of: {', '.join(wanted)}")
    if args.exercise and len(found) < len(wanted):
        missing = [n for n in wanted if n not in found]
        raise CLIError(f"{path} does not define {', '.join(missing)}")
    print(f"checking {len(found)} function{'s' if len(found) > 1 else ''} of {path}: {', '.join(found)}", flush=True)
    failed = 0
    for n in found:
        result = check(n, getattr(module, n), seed=args.seed, model=False if args.no_model else None)
        print(result, flush=True)
        failed += not result.passed
    print(f"{len(found) - failed} of {len(found)} passed")
    return 1 if failed else 0
