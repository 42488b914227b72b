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
            "openai", "matplotlib", "vllm", "sglang", "xgrammar", "llguidance"}
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


SOURCE_FOLDERS = tuple(FOLDERS.values()) + (ROOT / "scripts",)  # every non-test Python file lives under these
MAX_LINES = 600
MODEL = ROOT / "loopspec" / "model"


def source_files():
    for folder in SOURCE_FOLDERS:
        yield from sorted(folder.rglob("*.py"))


def kind_field_uses(path: Path, names) -> list[str]:
    """Where `path` reads (or writes) one of `names` as an attribute, or through getattr / setattr /
    hasattr with the name spelled out. An argparse namespace (`args`) is exempt: a flag spelled like a
    field (--markov-rank) is the user's request, not a drafter's kind."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        name = None
        if isinstance(node, ast.Attribute) and node.attr in names:
            if not (isinstance(node.value, ast.Name) and node.value.id == "args"):
                name = node.attr
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "setattr", "hasattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and node.args[1].value in names):
            name = node.args[1].value
        if name is not None:
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: .{name}")
    return found


def test_only_the_model_reads_a_drafter_kinds_fields():
    """Outside loopspec/model a drafter's kind is asked (DrafterConfig.kind), never read off its fields."""
    import dataclasses
    import inspect
    import textwrap

    from loopspec.model import drafter_kinds
    from loopspec.model.drafter import DrafterConfig

    names = set(drafter_kinds.KIND_FIELDS)
    config_names = {f.name for f in dataclasses.fields(DrafterConfig)} | set(vars(DrafterConfig))
    assert names <= config_names, f"KIND_FIELDS names what DrafterConfig lacks: {sorted(names - config_names)}"
    # the list covers every field the kind lookup reads, so a field added to a kind is guarded at once
    lookup = ast.parse(textwrap.dedent(inspect.getsource(drafter_kinds.drafter_kind)))
    param = lookup.body[0].args.args[0].arg
    read = {n.attr for n in ast.walk(lookup) if isinstance(n, ast.Attribute)
            and isinstance(n.value, ast.Name) and n.value.id == param}
    assert read and read <= names, f"drafter_kind reads fields KIND_FIELDS lacks: {sorted(read - names)}"
    problems = sorted(use for path in source_files() if not path.is_relative_to(MODEL)
                      for use in kind_field_uses(path, names))
    assert not problems, "ask DrafterConfig.kind instead of reading its fields:\n" + "\n".join(problems)


def test_no_source_file_is_over_the_line_limit():
    long = [f"{path.relative_to(ROOT)}: {n} lines" for path in source_files()
            if (n := len(path.read_text().splitlines())) > MAX_LINES]
    assert not long, f"split these by topic (at most {MAX_LINES} lines a file):\n" + "\n".join(long)
