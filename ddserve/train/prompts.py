"""Held-out prompts for `bench/eval_pair.py`: function headers from the corpus's eval split.

A prompt is one function of a held-out module as its source writes it: the `def` line(s) (no
decorators), then the first line of its docstring where it has one, dedented to column 0 and
ending *without* a newline. The tokenizer merges a line break with the next line's indentation
into one token, so a prompt that ends in a bare newline would end in a token the model never saw
there; ending at the header or the docstring line leaves that choice to the model. A docstring
whose first line is only the quotes takes its next line too (a
docstring that opens with a blank line counts as none).

Selection, deterministic from the manifest (`manifest/manifest.tsv`, split `eval`) and the
archive: each eligible module contributes at most one function, preferring one with a docstring,
then a top-level function over a method, then the smallest sha256 of `path:qualname`. Modules
are taken round-robin over the held-out units (units in sha256 order; within a unit, modules
with a docstring candidate first, then by sha256 of the path), so one large unit (e.g.
`encodings`) cannot fill the set; a prompt text already taken is skipped. Eligible: the header
spans at most 4 lines, the prompt has at most 400 characters, the body starts on a later line
than the header.

    python -m ddserve.train.prompts --corpus .train/corpus.tar.xz --out bench/heldout_prompts.json
"""

from __future__ import annotations

import argparse
import ast
import csv
import hashlib
import json
import tarfile
import textwrap
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

MANIFEST = Path(__file__).parent / "manifest" / "manifest.tsv"
MAX_HEADER_LINES = 4
MAX_CHARS = 400


@dataclass(frozen=True)
class Prompt:
    source: str  # "python-stdlib" or a package name
    path: str  # inside its source, as in manifest.tsv
    unit: str
    function: str  # qualified name: `f` or `Class.method`
    line: int  # 1-based line of the `def`
    has_docstring: bool
    prompt: str


def _sha(text: str) -> int:
    return int(hashlib.sha256(text.encode()).hexdigest(), 16)


def _functions(tree: ast.Module):
    """(qualname, node, is_method) for module-level functions and top-level classes' methods."""
    defs = (ast.FunctionDef, ast.AsyncFunctionDef)
    for node in tree.body:
        if isinstance(node, defs):
            yield node.name, node, False
        elif isinstance(node, ast.ClassDef):
            for sub in node.body:
                if isinstance(sub, defs):
                    yield f"{node.name}.{sub.name}", sub, True


def _docstring_lines(lines: list[str], first: ast.stmt) -> list[str]:
    """The docstring's first source line, plus the next one when the first is only quotes."""
    is_doc = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
    if not (is_doc and isinstance(first.value.value, str)):
        return []
    head = lines[first.lineno - 1].rstrip()
    if head.strip().lstrip("rRuUbB") not in ('"""', "'''"):
        return [head]
    nxt = lines[first.lineno].rstrip() if first.end_lineno > first.lineno else ""
    return [head, nxt] if nxt.strip() and nxt.strip() not in ('"""', "'''") else []


def header_prompt(lines: list[str], node: ast.FunctionDef | ast.AsyncFunctionDef) -> str | None:
    """The prompt for one function (see the module docstring), or None if it is not eligible."""
    first = node.body[0]
    if first.lineno <= node.lineno:
        return None  # `def f(): return 1` on one line
    header = [ln.rstrip() for ln in lines[node.lineno - 1 : first.lineno - 1]]
    while header and (not header[-1].strip() or header[-1].lstrip().startswith("#")):
        header.pop()  # comments or blank lines between the signature and the body
    if not header or len(header) > MAX_HEADER_LINES or not header[-1].endswith(":"):
        return None
    text = textwrap.dedent("\n".join(header + _docstring_lines(lines, first)))
    return text if len(text) <= MAX_CHARS and not text.startswith(" ") else None


def module_prompt(source: str, path: str, unit: str, text: str) -> Prompt | None:
    """The module's chosen function, or None when it has no eligible one."""
    lines = text.splitlines()
    best = None
    for qualname, node, is_method in _functions(ast.parse(text)):
        prompt = header_prompt(lines, node)
        if prompt is None:
            continue
        doc = bool(_docstring_lines(lines, node.body[0]))
        key = (not doc, is_method, _sha(f"{path}:{qualname}"))
        if best is None or key < best[0]:
            best = (key, Prompt(source, path, unit, qualname, node.lineno, doc, prompt))
    return None if best is None else best[1]


def read_eval_modules(corpus_tar: Path, manifest: Path) -> list[tuple[dict, str]]:
    """(manifest row, text) of every eval file, checked against the manifest's sha256."""
    with manifest.open(newline="") as f:
        rows = {f"eval/{r['source']}/{r['path']}": r for r in csv.DictReader(f, delimiter="\t")
                if r["split"] == "eval"}  # fmt: skip
    out = []
    with tarfile.open(corpus_tar, "r:*") as tar:
        for member in tar:
            row = rows.get(member.name)
            if row is None or not member.isfile():
                continue
            data = tar.extractfile(member).read()
            if hashlib.sha256(data).hexdigest() != row["sha256"]:
                raise ValueError(f"{member.name}: content differs from {manifest}")
            out.append((row, data.decode("utf-8")))
    if len(out) != len(rows):
        raise ValueError(f"{corpus_tar} holds {len(out)} of the {len(rows)} eval files")
    return out


def select(corpus_tar: Path, manifest: Path = MANIFEST, num: int = 64) -> list[Prompt]:
    """Up to `num` prompts from distinct modules, round-robin over units (module docstring)."""
    by_unit: dict[str, list[Prompt]] = defaultdict(list)
    for row, text in read_eval_modules(corpus_tar, manifest):
        p = module_prompt(row["source"], row["path"], row["unit"], text)
        if p is not None:
            by_unit[p.unit].append(p)
    queues = [
        sorted(ps, key=lambda p: (not p.has_docstring, _sha(f"{p.source}/{p.path}")))
        for _, ps in sorted(by_unit.items(), key=lambda kv: _sha(kv[0]))
    ]
    chosen, seen = [], set()
    for depth in range(max(map(len, queues), default=0)):
        for p in (q[depth] for q in queues if depth < len(q)):
            if p.prompt not in seen:  # `def getregentry():` of many codecs: once
                chosen.append(p)
                seen.add(p.prompt)
    return chosen[:num]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m ddserve.train.prompts", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--corpus", default=".train/corpus.tar.xz", help="stage 1's archive")
    p.add_argument("--manifest", default=str(MANIFEST), help="manifest.tsv naming the eval split")
    p.add_argument("--num", type=int, default=64, help="prompts to select")
    p.add_argument("--out", default="bench/heldout_prompts.json")
    args = p.parse_args(argv)
    prompts = select(Path(args.corpus), Path(args.manifest), args.num)
    doc = {
        "generator": "python -m ddserve.train.prompts",
        "rule": " ".join(__doc__.split("\n\n")[1:3]).replace("\n", " "),
        "manifest_sha256": hashlib.sha256(Path(args.manifest).read_bytes()).hexdigest(),
        "prompts": [asdict(x) for x in prompts],
    }
    Path(args.out).write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
    units = len({x.unit for x in prompts})
    with_doc = sum(x.has_docstring for x in prompts)
    print(f"wrote {len(prompts)} prompts ({units} units, {with_doc} with a docstring line) to "
          f"{args.out}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
