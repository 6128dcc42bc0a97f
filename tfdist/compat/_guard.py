"""What every entry of `tfdist.compat` shares: the verified versions, the
`UpstreamChanged` error and the checks that a private upstream name is there
and still used the way a workaround assumes (the package docstring says why).
Imports no TensorFlow and no Keras."""

from __future__ import annotations

import sys
import types

VERIFIED = "tensorflow 2.21.0, keras 3.15.1"


class UpstreamChanged(RuntimeError):
    """A private upstream name tfdist relies on is missing or behaves differently."""


def _installed() -> str:
    found = [f"{name} {getattr(sys.modules.get(name), '__version__', '?')}"
             for name in ("tensorflow", "keras") if name in sys.modules]
    return ", ".join(found) or "unknown"


def _changed(what: str, how: str = "is missing", verified: str = VERIFIED) -> UpstreamChanged:
    return UpstreamChanged(f"{what} {how}: tfdist's workaround was verified on {verified} "
                           f"(installed: {_installed()}); see tfdist/compat/")


def _require(owner, name: str, what: str):
    """`owner.name`, or `UpstreamChanged` naming `what`."""
    try:
        return getattr(owner, name)
    except AttributeError:
        raise _changed(what) from None


def _code_reads(function, name: str) -> bool:
    """Whether `function`'s code (or a function nested in it) reads attribute `name`."""
    code = getattr(function, "__code__", None)
    pending = [code] if code is not None else []
    while pending:
        code = pending.pop()
        if name in code.co_names:
            return True
        pending.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    return False


def _require_called(cls, method: str, name: str, what: str) -> None:
    """`UpstreamChanged` unless `cls.method` still reads `name` (else replacing
    or setting `name` would change nothing)."""
    function = getattr(cls, method, None)
    if function is None or not _code_reads(function, name):
        raise _changed(what, f"is no longer used by {cls.__name__}.{method}")
