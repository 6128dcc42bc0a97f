"""The user's functions (`model_fn`, `dataset_fn`), named so that a trial
process can import them again: a module-level function of an importable
module, or of the script that runs (`__main__`, imported again by its path
as a module: its `if __name__ == "__main__":` block does not run)."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from typing import Callable, Optional

from tfdist.errors import UsageError

_SCRIPT_MODULE = "tfdist_planned_script"


def reference(fn: Optional[Callable], what: str) -> Optional[dict]:
    """Where `fn` can be imported from, or `UsageError` naming `what`."""
    if fn is None:
        return None
    module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or not name or "<" in name:
        raise UsageError(f"{what}={fn!r}: a plan's trials run in processes of their own and "
                         "import it again, so it must be a module-level function (not a "
                         "lambda, a closure or a method)")
    path = getattr(sys.modules.get(module), "__file__", None)
    if module == "__main__":
        if not path:
            raise UsageError(f"{what}={name!r} is defined in an interactive session; define it "
                             "in a module or script file so trial processes can import it")
        return {"path": path, "name": name}
    # The module by name, else (not on a trial's path) by its file.
    return {"module": module, "name": name, "path": path}


def resolve(ref: Optional[dict]) -> Optional[Callable]:
    """The function `reference` named."""
    if not ref:
        return None
    module = None
    if ref.get("module"):
        try:
            module = importlib.import_module(ref["module"])
        except ImportError:
            if not ref.get("path"):
                raise
    if module is None:
        name = ref.get("module") or _SCRIPT_MODULE
        module = sys.modules.get(name)
        if module is None:
            spec = importlib.util.spec_from_file_location(name, ref["path"])
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
    target = module
    for part in ref["name"].split("."):
        target = getattr(target, part)
    return target


def rules_record(rules) -> Optional[dict]:
    """Layout rules (tfdist's or a Keras `LayoutMap`) as JSON for a trial."""
    if rules is None:
        return None
    from tfdist import sharding
    rules = sharding.as_layout_rules(rules)
    return {"rules": [[pattern, list(spec)] for pattern, spec in rules], "match": rules.match}


def layout_rules(record: Optional[dict]):
    """The `LayoutRules` `rules_record` wrote, or None."""
    if not record:
        return None
    from tfdist import sharding
    return sharding.LayoutRules([(p, tuple(s)) for p, s in record["rules"]],
                                match=record["match"])


def spec_record(spec) -> Optional[dict]:
    """A `DatasetSpec` as JSON for a trial."""
    import dataclasses
    return None if spec is None else dataclasses.asdict(spec)


def dataset_spec(record: Optional[dict]):
    if not record:
        return None
    from tfdist.data.spec import DatasetSpec
    return DatasetSpec(**{k: tuple(v) if isinstance(v, list) else v for k, v in record.items()})


def records(model_fn=None, dataset_fn=None, layout_rules=None, spec=None) -> dict:
    """The user's functions, layout rules and data spec as JSON for a child
    process (a trial, the --strategy=auto planner); `resolved` reads them."""
    return {"model_fn": reference(model_fn, "model_fn"),
            "dataset_fn": reference(dataset_fn, "dataset_fn"),
            "layout_rules": rules_record(layout_rules), "spec": spec_record(spec)}


def resolved(record: dict) -> dict:
    """`records`' keywords (model_fn, dataset_fn, layout_rules, spec) again."""
    return {"model_fn": resolve(record.get("model_fn")),
            "dataset_fn": resolve(record.get("dataset_fn")),
            "layout_rules": layout_rules(record.get("layout_rules")),
            "spec": dataset_spec(record.get("spec"))}
