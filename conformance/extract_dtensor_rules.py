"""Regenerate tfdist/strategies/dtensor/rules.py from a TensorFlow source tree.

DTensor lowers an op only if an SPMD expander is registered for its MLIR name
(`SPMDExpanderRegistry`, tensorflow/dtensor/mlir/spmd_expander.h); the
registrations are `REGISTER_SPMD(Name, TF::XOp, Expander, ...)` lines
(all of them in tensorflow/dtensor/mlir/spmd_expanders.cc in the TF 2.x
tree; every .cc under tensorflow/dtensor/mlir/ is scanned in case a later
version moves some). This script strips C++ comments (commented-out
registrations such as `// REGISTER_SPMD(SoftplusGrad, ...)` are NOT rules),
parses each registration, and writes the module.

Source, one of:
  --git-dir DIR --commit REV   a bare or normal TensorFlow git dir (`git show REV:path`)
  --source-root DIR            a checkout (or a directory holding copies of the files
                               at their repository paths)

  python conformance/extract_dtensor_rules.py --git-dir /work/.mirror/tensorflow+tensorflow/x.git \
      --commit v2.21.0 --out tfdist/strategies/dtensor/rules.py

Pure Python, no TensorFlow import.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

MLIR_DIR = "tensorflow/dtensor/mlir"
REGISTRY_HEADER = f"{MLIR_DIR}/spmd_expander.h"

# REGISTER_SPMD(Name, TF::FooOp, Expander[, args...]) and any REGISTER_SPMD_* variant
# whose second argument is a string op name ("tf.Foo").
_REG = re.compile(r"\b(REGISTER_SPMD\w*)\s*\(\s*(\w+)\s*,\s*([^,]+?)\s*,\s*(\w+)", re.S)


def strip_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def op_type(cpp_op: str) -> tuple[str, str]:
    """`TF::Conv2DOp` -> ("tf", "Conv2D"); `tf_device::ReturnOp` -> ("tf_device", "return");
    `"tf.Foo"` -> ("tf", "Foo"). TF dialect class names are the op name + "Op", except a
    few DTensor ops declared without the suffix (TF::DTensorSend)."""
    cpp_op = cpp_op.strip()
    if cpp_op.startswith('"'):
        dialect, _, name = cpp_op.strip('"').partition(".")
        return dialect, name
    ns, _, cls = cpp_op.rpartition("::")
    name = cls[:-2] if cls.endswith("Op") else cls
    if ns == "TF":
        return "tf", name
    return ns, name[:1].lower() + name[1:]   # tf_device::ReturnOp is "tf_device.return"


def parse(files: dict[str, str]) -> list[dict]:
    regs = []
    for path, text in sorted(files.items()):
        for m in _REG.finditer(strip_comments(text)):
            macro, reg_name, cpp_op, expander = m.groups()
            if macro == "REGISTER_SPMD" and reg_name == "name":   # the macro's own definition
                continue
            dialect, name = op_type(cpp_op)
            regs.append(dict(path=path, macro=macro, dialect=dialect, op=name, expander=expander))
    return regs


def read_git(git_dir: str, commit: str) -> tuple[dict[str, str], str]:
    git = ["git", "-C", git_dir]
    sha = subprocess.run(git + ["rev-parse", f"{commit}^{{commit}}"], check=True,
                         capture_output=True, text=True).stdout.strip()
    names = subprocess.run(git + ["ls-tree", "-r", "--name-only", sha, MLIR_DIR], check=True,
                           capture_output=True, text=True).stdout.split()
    files = {}
    for name in names:
        if name.endswith(".cc") or name == REGISTRY_HEADER:
            files[name] = subprocess.run(git + ["show", f"{sha}:{name}"], check=True,
                                         capture_output=True, text=True).stdout
    return files, sha


def read_tree(root: str) -> dict[str, str]:
    files = {}
    for dirpath, _, names in os.walk(os.path.join(root, MLIR_DIR)):
        for name in names:
            if name.endswith(".cc"):
                full = os.path.join(dirpath, name)
                with open(full, encoding="utf-8") as f:
                    files[os.path.relpath(full, root)] = f.read()
    return files


def packed(items: list[str], width: int = 99) -> list[str]:
    """`items` as lines of at most `width` characters, several to a line,
    indented by four (the module stays short: its house rule is 500 lines)."""
    lines: list[str] = []
    for item in items:
        if lines and len(lines[-1]) + 1 + len(item) <= width:
            lines[-1] += " " + item
        else:
            lines.append("    " + item)
    return lines


def render(regs: list[dict], source: str, note: str) -> str:
    tf_ops = sorted({r["op"] for r in regs if r["dialect"] == "tf"})
    other = sorted({f'{r["dialect"]}.{r["op"]}' for r in regs if r["dialect"] != "tf"})
    by_expander: dict[str, list[str]] = {}
    for r in regs:
        if r["dialect"] == "tf":
            by_expander.setdefault(r["expander"], []).append(r["op"])
    paths = sorted({r["path"] for r in regs})
    lines = ['"""TensorFlow op types DTensor can lay out (has an SPMD expander for), by TF version.',
             "",
             "DTensor compiles a function by giving every op in it a layout; an op whose MLIR",
             "name has no registered SPMD expander fails at compile time with \"'tf.X' op does",
             'not implement layout propagation" (layout_propagation_v2.cc), whatever the mesh,',
             "even a batch-only one and even with every input replicated. OPS_WITH_RULES is every",
             "TF op type with such a registration (op type names as in tf.raw_ops / a GraphDef,",
             'without the MLIR "tf." prefix). Being in the set says DTensor can lower the op, not',
             "how well: DataparallelSPMDExpander ops (DepthwiseConv2dNative, AvgPool, ...) shard",
             "only the batch dimension and gather anything else, ReplicatedOpSPMDExpander ones",
             "replicate all inputs. HANDLED_WITHOUT_RULES lists op types that never need one.",
             "",
             f"Source: {source}",
             f"Files: {', '.join(paths)}",
             "Extracted by conformance/extract_dtensor_rules.py: every REGISTER_SPMD* call in",
             f"{MLIR_DIR}/**/*.cc after stripping C++ comments (commented-out registrations,",
             "e.g. SoftplusGrad, SoftsignGrad, Snapshot, InplaceAdd, are not rules).",
             ]
    lines += note.splitlines()
    lines += ["",
              "Regenerate for another TensorFlow with",
              "  python conformance/extract_dtensor_rules.py --git-dir DIR --commit vX.Y.Z \\",
              "      --out tfdist/strategies/dtensor/rules.py",
              '"""', "",
              "# Generated; do not edit by hand (conformance/extract_dtensor_rules.py).", "",
              f"SOURCE = {source!r}", "",
              "OPS_WITH_RULES: frozenset[str] = frozenset({"]
    lines += packed([f"{op!r}," for op in tf_ops])
    lines += ["})", "",
              "# Registered expanders for ops outside the TF dialect (MLIR names).",
              f"NON_TF_OPS_WITH_RULES: frozenset[str] = frozenset({other!r})", "",
              "# Which expander each op has (tells batch-only and replicate-everything rules apart).",
              "EXPANDER = {"]
    lines += packed([f"{op!r}: {exp!r}," for exp in sorted(by_expander)
                     for op in sorted(set(by_expander[exp]))])
    lines += ["}", "", HANDLED_WITHOUT_RULES_SRC.rstrip(), "",
              "",
              "def has_rule(op_type: str) -> bool:",
              '    """True if DTensor lowers `op_type` ("MatMul" or "tf.MatMul") without extra',
              '    configuration."""',
              '    name = op_type[3:] if op_type.startswith("tf.") else op_type',
              "    return name in OPS_WITH_RULES or name in HANDLED_WITHOUT_RULES", ""]
    return "\n".join(lines)


# Kept by hand: read in TF's DTensor passes, not generated (check on a TF upgrade).
HANDLED_WITHOUT_RULES_SRC = '''
# Op types DTensor handles without an expander of their own (read in the TF source
# named above; re-check on a TF upgrade):
HANDLED_WITHOUT_RULES: dict[str, str] = {
    # dtensor_mlir_passes.cc: CreateTFFunctionalControlFlowToRegions() turns these into
    # tf.WhileRegion / tf.IfRegion (which have expanders) before layout propagation.
    "While": "functional-to-region pass, then WhileRegion's expander",
    "StatelessWhile": "functional-to-region pass, then WhileRegion's expander",
    "If": "functional-to-region pass, then IfRegion's expander",
    "StatelessIf": "functional-to-region pass, then IfRegion's expander",
    # dtensor_mlir_passes.cc: mlir::createInlinerPass() inlines function calls; calls left
    # standing are skipped as identities by TraceUseToNextTFOp (layout_propagation_v2.cc).
    "PartitionedCall": "inliner pass / skipped as an identity in layout propagation",
    "StatefulPartitionedCall": "inliner pass / skipped as an identity in layout propagation",
    # layout_propagation_v2.cc: InsertLayoutsForDTensorLayout reads the layout these carry
    # (what dtensor.relayout/pack/variables insert); removed after SPMD expansion.
    "DTensorLayout": "layout_propagation_v2.cc: its layout is the request; removed after expansion",
    # Region terminators: skipped as identities by TraceUseToNextTFOp.
    "Yield": "region terminator, skipped as an identity in layout propagation",
    # layout_propagation_v2.cc InsertInitialLayoutsFromComputeLayout: ops with neither a
    # traced operand nor a traced result (NoOp, control-only ops) are never asked.
    "NoOp": "no tensor operands or results: never given a layout",
    # dtensor_utils.cc EnableReplicatedSpmdAsDefault + spmd_expander.cc
    # GetPropagateFnForFullOpName: ANY op without a rule is lowered replicated when the
    # environment has DTENSOR_ENABLE_REPLICATED_SPMD_AS_DEFAULT_<TF.OPNAME upper-cased>
    # set (e.g. ..._TF.DEPTHWISECONV2DNATIVEBACKPROPFILTER=1) before the compile.
}
'''


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--git-dir")
    p.add_argument("--commit", help="tag, branch or sha (with --git-dir)")
    p.add_argument("--source-root", help="a TensorFlow checkout or copies at repository paths")
    p.add_argument("--source-label", help="what to record as the source (default: derived)")
    p.add_argument("--note", default="", help="extra docstring lines (provenance caveats)")
    p.add_argument("--out", default="-")
    a = p.parse_args(argv)
    if a.git_dir:
        if not a.commit:
            p.error("--git-dir needs --commit")
        files, sha = read_git(a.git_dir, a.commit)
        label = a.source_label or f"tensorflow/tensorflow {a.commit} ({sha})"
    elif a.source_root:
        files = read_tree(a.source_root)
        label = a.source_label or f"TensorFlow source tree {a.source_root}"
    else:
        p.error("give --git-dir and --commit, or --source-root")
    regs = parse(files)
    if not any(r["op"] == "MatMul" for r in regs):
        sys.exit(f"no REGISTER_SPMD(MatMul, ...) found under {MLIR_DIR}: wrong tree or layout?")
    text = render(regs, label, a.note)
    if a.out == "-":
        sys.stdout.write(text)
    else:
        with open(a.out, "w", encoding="utf-8") as f:
            f.write(text)
        print(f"{a.out}: {len({r['op'] for r in regs if r['dialect'] == 'tf'})} TF op types "
              f"from {len(regs)} registrations", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
