"""How the codebase reads (issue 18's measures): the largest module under src/, the longest
functions, and the imports that cross stages.

A stage is a pipeline command's package (data, extract, train, export, evaluate); an import from
one stage's module of another stage's module crosses stages. The libraries the stages share (draft,
vllm, features, and the top-level modules) are counted apart: importing those is their purpose.

    python scripts/code_shape.py [SRC_DIR]     # default: src/eyas of this checkout
"""

from __future__ import annotations

import ast
import sys
from collections import Counter
from pathlib import Path


def main(root: Path) -> None:
    files = sorted(root.rglob("*.py"))
    packages = {p.name for p in root.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    stages = {"data", "extract", "train", "export", "evaluate"} & packages
    sizes = sorted(((len(f.read_text().splitlines()), f) for f in files), reverse=True)
    funcs: list[tuple[int, str]] = []
    cross: Counter[tuple[str, str]] = Counter()
    shared: Counter[tuple[str, str]] = Counter()
    private: list[str] = []
    inner = 0
    for f in files:
        rel = f.relative_to(root)
        stage = rel.parts[0] if len(rel.parts) > 1 else None
        tree = ast.parse(f.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                funcs.append((node.end_lineno - node.lineno + 1, f"{rel}:{node.lineno} {node.name}"))
                inner += sum(isinstance(n, (ast.Import, ast.ImportFrom)) for n in ast.walk(node))
            mods: list[tuple[str, list[str]]] = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                mods = [(node.module, [a.name for a in node.names])]
            elif isinstance(node, ast.Import):
                mods = [(a.name, []) for a in node.names]
            for mod, names in mods:
                parts = mod.split(".")
                if parts[0] != "eyas" or len(parts) < 2 or parts[1] not in packages or stage is None:
                    continue
                if parts[1] != stage:
                    (cross if parts[1] in stages and stage in stages else shared)[(stage, parts[1])] += 1
                    private += [f"{rel}: {mod}.{n}" for n in names if n.startswith("_")]
    funcs.sort(reverse=True)
    print(f"modules: {len(files)}, lines: {sum(s for s, _ in sizes)}")
    print("largest modules:", ", ".join(f"{f.relative_to(root)} ({s})" for s, f in sizes[:3]))
    print("longest functions:", ", ".join(f"{name} ({n})" for n, name in funcs[:3]))
    print(
        f"imports that cross stages: {sum(cross.values())} "
        f"({', '.join(f'{a}->{b} {n}' for (a, b), n in sorted(cross.items()))})"
    )
    print(
        f"imports of a shared library package: {sum(shared.values())} "
        f"({', '.join(f'{a}->{b} {n}' for (a, b), n in sorted(shared.items()))})"
    )
    print(f"private names imported across packages: {len(private)}" + (f" ({'; '.join(private)})" if private else ""))
    print(f"imports inside function bodies: {inner}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1] / "src" / "eyas")
