"""Strict JSON for everything gradlab writes: undefined is `null` with its reason, never a number.

JSON has no NaN or Infinity; Python's `json` writes them as bare `NaN` / `Infinity` tokens that
strict parsers (browsers, `jq`, most languages) reject, and writing 0 instead would say
"measured and cancelled". The one convention:

- a non-finite float (an undefined ratio, share or spread) is written as `null`;
- the object holding it gets an `"undefined"` entry mapping that key to the reason, e.g.
  `{"rho_prefix": null, "undefined": {"rho_prefix": "no full-group token"}}`. The reason is the
  caller's where it knows one (`reasons=`), else "not a number" / "infinite";
- a non-finite float inside a list is `null`; the object holding the list gives the reason
  under the list's key (the caller's, e.g. `{"rho": [0.1, null], "undefined": {"rho": "no
  shared token (seed 1)"}}`, else "not a number" / "infinite"); a list alone has no keys to
  give a reason by.

`loads` reads such a file back with `null` as NaN where it stood for an undefined value (a
value, or an element of a list, whose key the `"undefined"` entry names; any other `null`
stays None), and `undefined_reasons` returns the reasons of one object.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

UNDEFINED = "undefined"
NOT_A_NUMBER = "not a number"
INFINITE = "infinite"


def _reason_of(x: float) -> str:
    return NOT_A_NUMBER if math.isnan(x) else INFINITE


def _plain(v: Any) -> Any:
    """Tensors, numpy scalars and arrays as Python values (no conversion of anything else)."""
    if hasattr(v, "detach") and hasattr(v, "tolist"):  # torch.Tensor
        v = v.detach().cpu()
        return v.item() if v.numel() == 1 and v.dim() == 0 else v.tolist()
    if type(v).__module__ == "numpy":
        return v.tolist() if hasattr(v, "tolist") else v.item()
    return v


def strict(obj: Any, reasons: Mapping[str, str] | None = None) -> Any:
    """`obj` with every non-finite float replaced by None, and an `"undefined"` entry in each
    mapping that held one (key → reason; `reasons` gives the top-level mapping's reasons)."""
    obj = _plain(obj)
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, Mapping):
        out: dict = {}
        why: dict[str, str] = dict(obj.get(UNDEFINED) or {}) if isinstance(
            obj.get(UNDEFINED), Mapping) else {}
        for k, v in obj.items():
            if k == UNDEFINED and isinstance(v, Mapping):
                continue
            v = _plain(v)
            if isinstance(v, float) and not math.isfinite(v):
                why[str(k)] = (reasons or {}).get(str(k)) or why.get(str(k)) or _reason_of(v)
                out[k] = None
            else:
                out[k] = strict(v)
                bad = [x for x in v if isinstance(x, float) and not math.isfinite(x)] if isinstance(
                    v, (list, tuple)) else []
                if bad:
                    why[str(k)] = (reasons or {}).get(str(k)) or why.get(str(k)) or _reason_of(bad[0])
        if why:
            out[UNDEFINED] = dict(sorted(why.items()))
        return out
    if isinstance(obj, (list, tuple)):
        return [strict(v) for v in obj]
    return obj


def dumps(obj: Any, *, reasons: Mapping[str, str] | None = None, **kw: Any) -> str:
    """`json.dumps` of `strict(obj, reasons)`: never a NaN or Infinity token (`allow_nan=False`
    holds it to that). Keyword arguments go to `json.dumps` (indent, sort_keys, ...)."""
    kw.pop("allow_nan", None)
    return json.dumps(strict(obj, reasons), allow_nan=False, **kw)


def _nan_back(obj: Any) -> Any:
    if isinstance(obj, dict):
        why = obj.get(UNDEFINED) if isinstance(obj.get(UNDEFINED), dict) else {}
        return {k: (math.nan if (v is None and k in why) else
                    [math.nan if x is None else _nan_back(x) for x in v]
                    if isinstance(v, list) and k in why else _nan_back(v))
                for k, v in obj.items()}
    if isinstance(obj, list):
        return [_nan_back(v) for v in obj]
    return obj


def loads(text: str | bytes) -> Any:
    """Parse strict JSON (NaN / Infinity tokens are refused) and turn each `null` that an
    `"undefined"` entry explains back into NaN; the `"undefined"` entries stay."""

    def refuse(token: str) -> float:
        raise ValueError(f"not strict JSON: a bare {token} token")

    return _nan_back(json.loads(text, parse_constant=refuse))


def undefined_reasons(obj: Mapping) -> dict[str, str]:
    """key → reason for the undefined values of one object read with `loads` (or json)."""
    why = obj.get(UNDEFINED)
    return dict(why) if isinstance(why, Mapping) else {}
