"""The import arrows (core ← engines ← convert, runtime), no bare subpackage imports, and packaging that matches the folders."""

import ast
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"loopspec": ROOT / "loopspec", "loopspec.engines": ROOT / "engines",
           "loopspec.convert": ROOT / "convert", "loopspec.runtime": ROOT / "runtime", "loopspec.cli": ROOT / "cli"}
OPTIONAL = {"onnxruntime", "onnx", "onnxscript", "tensorrt", "tensorrt_llm", "modelopt", "fastapi", "uvicorn",
            "openai", "matplotlib", "vllm", "sglang"}
STDLIB = set(sys.stdlib_module_names)


def layer_of(path: Path) -> str:
    rel = path.relative_to(ROOT).parts
    if rel[0] in ("engines", "convert", "runtime", "cli"):
        return rel[0]
    if rel[:2] == ("loopspec", "train"):
        return "train"
    return "core"


def imports(path: Path):
    """(module, is_top_level) for every import in the file, relative imports resolved."""
    tree = ast.parse(path.read_text(), str(path))
    top = set(id(n) for n in tree.body)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, id(node) in top
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                raise AssertionError(f"{path}: use absolute imports (loopspec....)")
            yield node.module, id(node) in top


def target_layer(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "loopspec":
        return None
    if len(parts) > 1 and parts[1] in ("engines", "convert", "runtime", "train", "cli"):
        return parts[1]
    return "core"


ALLOWED = {
    "core": {"core"},
    "train": {"core", "train"},
    "engines": {"core", "engines"},
    "convert": {"core", "engines", "convert"},
    "runtime": {"core", "engines", "runtime"},
    "cli": {"core", "train", "engines", "convert", "runtime", "cli"},
}


def python_files():
    for folder in FOLDERS.values():
        yield from sorted(folder.rglob("*.py"))


def test_import_arrows():
    problems = []
    for path in python_files():
        layer = layer_of(path)
        for module, top_level in imports(path):
            root = module.split(".")[0]
            if root in ("runtime", "convert", "engines", "cli"):
                problems.append(f"{path}: bare import of {module!r} (use loopspec.{module})")
            dest = target_layer(module)
            if dest is not None and dest not in ALLOWED[layer]:
                problems.append(f"{path}: {layer} must not import {module}")
            if layer == "runtime" and (module.startswith("torch.onnx") or root == "modelopt"):
                problems.append(f"{path}: runtime must not import {module}")
            if top_level and root in OPTIONAL:
                problems.append(f"{path}: optional library {root} imported at module level (import it lazily)")
            if top_level and layer in ("core", "train") and dest is None and root not in STDLIB | {"torch", "numpy"}:
                problems.append(f"{path}: core imports {root} at module level (core is torch + numpy)")
    assert not problems, "\n".join(problems)


def test_declared_packages_match_folders():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    declared = set(config["packages"])
    mapping = config["package-dir"]
    found = set()
    for name, folder in FOLDERS.items():
        assert name == "loopspec" or mapping[name] == folder.name
        for init in folder.rglob("__init__.py"):
            rel = init.parent.relative_to(folder).parts
            found.add(".".join((name,) + rel))
    assert declared == found


def module_name(path: Path) -> str:
    for name, folder in FOLDERS.items():
        if path.is_relative_to(folder):
            rel = path.relative_to(folder).with_suffix("").parts
            rel = rel[:-1] if rel[-1] == "__init__" else rel
            return ".".join((name,) + rel)
    raise AssertionError(path)


def test_no_import_cycles():
    """No module reaches, through any chain of imports (function-level ones included), back to itself:
    a cycle hidden in a function-level import is still a layering knot."""
    modules = {module_name(p): p for p in python_files()}
    graph = {}
    for name, path in modules.items():
        targets = set()
        for module, _ in imports(path):
            # `from loopspec.x import y` may name a submodule y or a name in x: take the longest module
            candidates = [module] + [module.rsplit(".", 1)[0]] if module else []
            found = next((c for c in candidates if c in modules), None)
            if found and found != name and not name.startswith(found + "."):  # a package's own __init__
                targets.add(found)
        graph[name] = targets
    cycles, state = [], {}

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, "import cycles:\n" + "\n".join(" → ".join(c) for c in cycles)


def test_engines_are_reached_through_backends():
    """Outside engines/, an engine comes from engines/backends.py and is held as an `Engine`: no module
    imports a backend's own module, nor a backend class from anywhere, so every caller (validation
    included) runs an engine the way the runtime opens it. convert/trt.py builds plans with
    engines/trt_engine.py's helpers, which open no engine."""
    backend_modules = {"loopspec.engines.torch_engine", "loopspec.engines.cuda_graphs",
                       "loopspec.engines.artifact_engine", "loopspec.engines.ort_engine"}
    backend_classes = {"TorchEngine", "OrtEngine", "TrtEngine", "ArtifactEngine", "EngineSession"}
    problems = []
    for path in python_files():
        if layer_of(path) == "engines":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                modules, names = [alias.name for alias in node.names], []
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [alias.name for alias in node.names]
                modules = [node.module] + [f"{node.module}.{name}" for name in names]  # `from pkg import module`
            else:
                continue
            hits = {m for m in backend_modules for x in modules if x == m or x.startswith(m + ".")}
            for backend in sorted(hits):
                problems.append(f"{path}:{node.lineno}: imports {backend} (open engines through "
                                f"loopspec.engines.backends, hold them as Engine)")
            for name in names:
                if name in backend_classes:
                    problems.append(f"{path}:{node.lineno}: imports {name} (hold engines as "
                                    f"loopspec.engines.protocol.Engine)")
    assert not problems, "\n".join(problems)
