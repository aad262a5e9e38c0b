"""The import contract: which layer may import which, no import cycle (imports inside functions
counted), no private name imported from another module. Read from the source with ``ast``: nothing
is imported.

Layers, lowest first; a module may import its own layer and the layers below it, never one above:

    schemas -> collate -> loaders.{errors,policy} -> loaders.sources -> loaders.handoff
    -> loaders.media -> loaders.index -> loaders.plan -> loaders.serve
    -> loaders (options, state, loader, streaming, ...) -> loaders.cli
    -> prealign (the package's lazy entry points)
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
FOLDERS = {
    "prealign.collate": "collate",
    "prealign.loaders": "loaders",
    "prealign.schemas": "schemas",
    "prealign": "src/prealign",
}

LAYERS = [
    ("schemas", ["prealign.schemas"]),
    ("collate", ["prealign.collate"]),
    ("loaders base", ["prealign.loaders.errors", "prealign.loaders.policy"]),
    ("sources", ["prealign.loaders.sources"]),
    ("handoff", ["prealign.loaders.handoff"]),
    ("media", ["prealign.loaders.media"]),
    ("index", ["prealign.loaders.index"]),
    ("plan", ["prealign.loaders.plan"]),
    ("serve", ["prealign.loaders.serve"]),
    ("loaders", ["prealign.loaders"]),
    ("cli", ["prealign.loaders.cli"]),
    ("package", ["prealign"]),
]


def layer_of(module: str) -> int:
    """Index in LAYERS of the most specific prefix of ``module``."""
    best, depth = None, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and p.count(".") > depth:
                best, depth = i, p.count(".")
    assert best is not None, module
    return best


def modules() -> dict[str, pathlib.Path]:
    """Every module of the package: dotted name -> file."""
    found = {}
    for package, folder in FOLDERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            name = ".".join((package, *parts))
            found[name.removesuffix(".__init__")] = path
    return found


def imports(name: str, path: pathlib.Path, known: dict) -> list[tuple[int, str, list[str]]]:
    """(line, imported module, names) of every import of a prealign module in ``path``, at any
    depth."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target != "prealign" and not target.startswith("prealign."):
                continue
            for alias in node.names:  # `from pkg import module` imports the module
                sub = f"{target}.{alias.name}"
                out.append(
                    (node.lineno, sub, []) if sub in known else (node.lineno, target, [alias.name])
                )
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name, []) for a in node.names if a.name.startswith("prealign.")]
    return out


def graph() -> tuple[dict, list[str]]:
    known = modules()
    edges, private = {}, []
    for name, path in known.items():
        edges[name] = set()
        for line, target, names in imports(name, path, known):
            assert target in known, (
                f"{path.relative_to(ROOT)}:{line} imports unknown module {target}"
            )
            edges[name].add(target)
            private += [
                f"{path.relative_to(ROOT)}:{line} imports {target}.{n}"
                for n in names
                if n.startswith("_") and target != name
            ]
    return edges, private


def test_every_import_goes_down_the_layers():
    edges, _ = graph()
    wrong = [
        f"{a} ({LAYERS[layer_of(a)][0]}) imports {b} ({LAYERS[layer_of(b)][0]})"
        for a, targets in edges.items()
        for b in targets
        if layer_of(b) > layer_of(a) and not (a == "prealign" or b.startswith(a + "."))
    ]
    assert sum(map(len, edges.values())) > 150
    assert not wrong, "\n".join(wrong)


def test_no_import_cycle_even_inside_functions():
    edges, _ = graph()
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    cycles = []

    def visit(node, stack):
        state[node] = 1
        for nxt in sorted(edges[node]):
            if nxt.startswith(node + "."):  # a package importing its own submodules is no cycle
                continue
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module, [module])
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_no_private_name_is_imported_from_another_module():
    _, private = graph()
    assert not private, "\n".join(private)


def test_loaders_keeps_at_most_twelve_modules_at_its_top():
    top = sorted(p.name for p in (ROOT / "loaders").glob("*.py"))
    assert 3 <= len(top) <= 12, top


@pytest.mark.parametrize(
    "module,expected",
    [
        ("prealign.loaders.sources.remote", "sources"),
        ("prealign.loaders.loader", "loaders"),
        ("prealign.loaders.errors", "loaders base"),
        ("prealign.schemas.layout", "schemas"),
    ],
)
def test_layer_of_takes_the_most_specific_prefix(module, expected):
    assert LAYERS[layer_of(module)][0] == expected
