"""A user's loss, `module:fn` or `path/file.py:fn`: import it (working directory first), run it
guarded, and report what it raised (exit code 3) apart from a bad argument (2) and, in
`gradlab check --loss`, a cancellation violation (1). The loop trains one as an objective
through `gradlab.core.userobjective.UserObjective` (`--objectives my_losses.py:dr_grpo`)."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path

import torch


class UserLossError(Exception):
    """The user's loss raised (or returned something other than a scalar tensor): exit 3."""


def guarded(fn: Callable, spec: str) -> Callable:
    """fn, with whatever it raises wrapped in UserLossError (the cause keeps its traceback)."""
    def loss(batch):
        try:
            out = fn(batch)
        except Exception as e:
            raise UserLossError(f"--loss {spec} raised {type(e).__name__}: {e}") from e
        if not torch.is_tensor(out) or out.dim() != 0:
            what = f"shape {tuple(out.shape)}" if torch.is_tensor(out) else type(out).__name__
            raise UserLossError(f"--loss {spec} returned {what}; expected a scalar tensor")
        return out
    return loss


def load_loss(spec: str, option: str = "--loss") -> Callable:
    """The function `spec` names (`module:fn` or `path/file.py:fn`). A missing file, module or
    function is a bad argument (ValueError naming `option` and the spec); an exception raised
    while importing the user's module is the user's (UserLossError)."""
    if ":" not in spec:
        raise ValueError(f"{option} {spec!r}: expected module:function or path/file.py:function")
    mod_name, fn_name = spec.rsplit(":", 1)
    if mod_name.endswith(".py"):
        path = Path(mod_name)
        if not path.is_file():
            raise ValueError(f"{option} {spec!r}: no file {path}")
        s = importlib.util.spec_from_file_location(path.stem, path)
        mod = importlib.util.module_from_spec(s)
        try:
            s.loader.exec_module(mod)
        except Exception as e:
            raise UserLossError(f"{option} {spec}: importing {path} raised {e!r}") from e
    else:
        mod = _import_from_cwd(mod_name, spec, option)
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        raise ValueError(f"{option} {spec!r}: {mod_name} has no callable {fn_name!r}")
    return fn


def _import_from_cwd(name: str, spec: str, option: str = "--loss"):
    """Import `name` with the working directory first on sys.path (the `gradlab` console
    script does not put it there). A missing module is a bad argument (ValueError); an
    exception raised while importing the user's module is the user's (UserLossError)."""
    cwd = str(Path.cwd())
    added = cwd not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name and (name == e.name or name.startswith(e.name + ".")):
            raise ValueError(f"{option} {spec!r}: no module {e.name!r} (looked in {cwd} and "
                             "the installed packages)") from None
        raise UserLossError(f"{option} {spec}: importing {name} raised {e!r}") from e
    except Exception as e:
        raise UserLossError(f"{option} {spec}: importing {name} raised {e!r}") from e
    finally:
        if added:
            sys.path.remove(cwd)


def report_raised(e: UserLossError) -> int:
    """Exit code 3: the user's traceback, then one line saying so."""
    import traceback

    cause = e.__cause__
    if cause is not None:
        traceback.print_exception(type(cause), cause, cause.__traceback__, file=sys.stderr)
    print(f"gradlab check: error: {e} (exit code 3: a fault in your "
          "loss, not a cancellation violation)", file=sys.stderr)
    return 3
