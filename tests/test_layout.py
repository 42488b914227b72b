"""The import arrows (core ← engines ← convert, runtime), no bare subpackage imports, and packaging that
matches the folders."""

import ast
import re
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {
    "loopspec": ROOT / "loopspec",
    "loopspec.engines": ROOT / "engines",
    "loopspec.convert": ROOT / "convert",
    "loopspec.runtime": ROOT / "runtime",
    "loopspec.cli": ROOT / "cli",
}
OPTIONAL = {
    "onnxruntime",
    "onnx",
    "onnxscript",
    "tensorrt",
    "tensorrt_llm",
    "modelopt",
    "fastapi",
    "uvicorn",
    "openai",
    "matplotlib",
    "vllm",
    "sglang",
    "xgrammar",
    "llguidance",
}
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
                cycles.append(stack[stack.index(nxt) :] + [nxt])
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
    backend_modules = {
        "loopspec.engines.torch_engine",
        "loopspec.engines.cuda_graphs",
        "loopspec.engines.artifact_engine",
        "loopspec.engines.ort_engine",
    }
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
                problems.append(
                    f"{path}:{node.lineno}: imports {backend} (open engines through "
                    f"loopspec.engines.backends, hold them as Engine)"
                )
            for name in names:
                if name in backend_classes:
                    problems.append(
                        f"{path}:{node.lineno}: imports {name} (hold engines as loopspec.engines.protocol.Engine)"
                    )
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
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr", "hasattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in names
        ):
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
    from loopspec.model.dflash import DrafterConfig

    names = set(drafter_kinds.KIND_FIELDS)
    config_names = {f.name for f in dataclasses.fields(DrafterConfig)} | set(vars(DrafterConfig))
    assert names <= config_names, f"KIND_FIELDS names what DrafterConfig lacks: {sorted(names - config_names)}"
    # the list covers every field the kind lookup reads, so a field added to a kind is guarded at once
    lookup = ast.parse(textwrap.dedent(inspect.getsource(drafter_kinds.drafter_kind)))
    param = lookup.body[0].args.args[0].arg
    read = {
        n.attr
        for n in ast.walk(lookup)
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == param
    }
    assert read and read <= names, f"drafter_kind reads fields KIND_FIELDS lacks: {sorted(read - names)}"
    problems = sorted(
        use for path in source_files() if not path.is_relative_to(MODEL) for use in kind_field_uses(path, names)
    )
    assert not problems, "ask DrafterConfig.kind instead of reading its fields:\n" + "\n".join(problems)


def test_no_source_file_is_over_the_line_limit():
    long = [
        f"{path.relative_to(ROOT)}: {n} lines"
        for path in source_files()
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    ]
    assert not long, f"split these by topic (at most {MAX_LINES} lines a file):\n" + "\n".join(long)


# ---- scripts/ ------------------------------------------------------------------------------------
# A script may import any layer of loopspec (it stands outside the package, above cli/), but only its
# public names: a private one (`_x`) may change or vanish with no caller in the package to notice.
# (That every script answers --help from a main() behind `if __name__ == "__main__":` is
# tests/test_scripts.py's.)

SCRIPTS = ROOT / "scripts"
# (script, private name) of a third-party object a script may reach: not loopspec's, so not ours to make public
THIRD_PARTY_PRIVATE = {
    # vLLM's VllmConfig names no public predicate for "the draft is a DFlash candidate-head (DFlash2)
    # model"; the script runs vLLM's own configuration code and asks it what vLLM itself asks
    ("check_bundles_parsers.py", "_is_dflash_candidate_draft"),
}


def private_reaches(path: Path) -> list[str]:
    """Where a script reaches a private member of loopspec code: imports a private name or module
    (`from loopspec.x import _y`), reads `obj._y` on anything but `self` / `cls` (dunders aside,
    THIRD_PARTY_PRIVATE allowed), or, in a subclass of a loopspec class, defines or calls a private
    method of its base (an override of `_y` leans on the base's internals as much as a read)."""
    label = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
    tree = ast.parse(path.read_text(), str(path))
    private = lambda name: name.startswith("_") and not (name.startswith("__") and name.endswith("__"))  # noqa: E731
    found, loopspec_names = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "loopspec":
            loopspec_names |= {alias.asname or alias.name for alias in node.names}
            for name in node.module.split(".") + [alias.name for alias in node.names]:
                if private(name):
                    found.append(f"{label}:{node.lineno}: imports {name} from {node.module}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in ("runtime", "convert", "engines", "cli"):
                    found.append(f"{label}:{node.lineno}: bare import of {alias.name} (use loopspec.{alias.name})")
                if alias.name.split(".")[0] == "loopspec" and any(map(private, alias.name.split("."))):
                    found.append(f"{label}:{node.lineno}: imports {alias.name}")
        if (
            isinstance(node, ast.ImportFrom)
            and node.module
            and node.module.split(".")[0] in ("runtime", "convert", "engines", "cli")
        ):
            found.append(f"{label}:{node.lineno}: bare import of {node.module} (use loopspec.{node.module})")
    subclassed = set()  # private members a subclass of a loopspec class defines (overrides)
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and any(
            isinstance(b, ast.Name) and b.id in loopspec_names for b in node.bases
        ):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and private(item.name):
                    subclassed.add(item.name)
                    found.append(f"{label}:{item.lineno}: {node.name} overrides {item.name}")
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and private(node.attr)):
            continue
        owner = node.value.id if isinstance(node.value, ast.Name) else None
        if owner in ("self", "cls") and node.attr not in subclassed:
            continue
        if (path.name, node.attr) in THIRD_PARTY_PRIVATE:
            continue
        shown = owner or (
            "super()" if isinstance(node.value, ast.Call) and getattr(node.value.func, "id", "") == "super" else "…"
        )
        found.append(f"{label}:{node.lineno}: {shown}.{node.attr}")
    return sorted(set(found), key=lambda s: (s.split(":")[0], int(s.split(":")[1]), s))


def test_scripts_reach_no_private_member_of_loopspec():
    problems = [p for path in sorted(SCRIPTS.glob("*.py")) for p in private_reaches(path)]
    assert not problems, "give what a script needs a public name where it belongs:\n" + "\n".join(problems)


def test_private_reach_check_catches_planted_ones(tmp_path):
    """The check on scripts that do what scripts/lone_step_ab.py, gpu_cost.py and grammar_mask_cost.py
    once did; and on one that reaches nothing private (its own private helpers, dunders)."""
    planted = tmp_path / "planted.py"
    planted.write_text(
        "from loopspec.engines.backends import artifact_engine\n"
        "from loopspec.engines.torch_engine import TorchEngine\n"
        "from loopspec.runtime.constraint import _xgrammar\n"
        "\n"
        "class Oracle(TorchEngine):\n"
        "    def _static_runner(self):\n"
        "        return super()._static_runner()\n"
        "\n"
        "def main():\n"
        "    engine = artifact_engine('onnxruntime', 'dir')\n"
        "    out = engine._run_target([0], [[1]], 1, all_logits=True)\n"
        "    return out, constraint._bitmask\n"
    )
    assert private_reaches(planted) == [
        "planted.py:3: imports _xgrammar from loopspec.runtime.constraint",
        "planted.py:6: Oracle overrides _static_runner",
        "planted.py:7: super()._static_runner",
        "planted.py:11: engine._run_target",
        "planted.py:12: constraint._bitmask",
    ]
    clean = tmp_path / "clean.py"
    clean.write_text(
        "from loopspec.engines.backends import artifact_engine\n"
        "\n"
        "class Timer:\n"
        "    def __init__(self):\n"
        "        self._start = 0\n"
        "\n"
        "    def _tick(self):\n"
        "        return self._start, self.__class__.__name__\n"
        "\n"
        "def main():\n"
        "    return artifact_engine('onnxruntime', 'dir').run_target([0], [[1]], 1, all_logits=True)\n"
    )
    assert private_reaches(clean) == []
    vllm = tmp_path / "check_bundles_parsers.py"  # the allowed third-party name, in its own script only
    vllm.write_text("def check(config):\n    return config._is_dflash_candidate_draft()\n")
    assert private_reaches(vllm) == []
    vllm.rename(tmp_path / "other.py")
    assert private_reaches(tmp_path / "other.py") == ["other.py:2: config._is_dflash_candidate_draft"]


# ---- drafter families ----------------------------------------------------------------------------
# A drafter family's files carry its name as their prefix (docs/architecture.md, "a drafter family");
# the engines call a drafter's context through engines/protocol.py `DrafterContext`, looked up by its
# kind in engines/drafter_contexts.py. The engines' backends and the runtime therefore never test which
# family a drafter is: no import of a family's engine modules, no read of a kind's family markers, no
# isinstance against a family's classes.
FAMILY_BLIND = (
    sorted(ROOT.glob("engines/*_engine.py")) + [ROOT / "engines" / "protocol.py"] + sorted(ROOT.glob("runtime/**/*.py"))
)
FAMILY_ENGINE_MODULES = re.compile(r"loopspec\.engines\.(dflash|dflash2|dspark|eagle3)_")
FAMILY_MARKERS = {"chain", "selector", "eagle3", "markov", "confidence", "convention", "name", "family", "context"}
FAMILY_CLASSES = re.compile(r"^(Eagle3|DFlash2|DSpark|DFlash)\w*$|^Drafter$")


def family_tests(path: Path) -> list[str]:
    """Where `path` tests a drafter's family: an import of a family's engine module, a read of a kind's
    family marker (`….kind.chain`, `kind.selector`, …), an isinstance against a family's class."""
    found = []
    where = path.name if not path.is_relative_to(ROOT) else path.relative_to(ROOT)
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and FAMILY_ENGINE_MODULES.match(node.module):
            found.append(f"{where}:{node.lineno}: imports {node.module}")
        elif isinstance(node, ast.Import):
            found += [
                f"{where}:{node.lineno}: imports {a.name}" for a in node.names if FAMILY_ENGINE_MODULES.match(a.name)
            ]
        elif (
            isinstance(node, ast.Attribute)
            and node.attr in FAMILY_MARKERS
            and isinstance(node.value, (ast.Attribute, ast.Name))
            and (node.value.attr if isinstance(node.value, ast.Attribute) else node.value.id) == "kind"
        ):
            found.append(f"{where}:{node.lineno}: reads kind.{node.attr}")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "isinstance"
            and len(node.args) == 2
        ):
            classes = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
            named = [c.id if isinstance(c, ast.Name) else getattr(c, "attr", "") for c in classes]
            found += [f"{where}:{node.lineno}: isinstance(…, {n})" for n in named if FAMILY_CLASSES.match(n)]
    return sorted(found, key=lambda hit: int(hit.split(":")[1]))


def test_engines_and_runtime_never_test_a_drafters_family():
    assert len(FAMILY_BLIND) > 20 and ROOT / "engines" / "torch_engine.py" in FAMILY_BLIND
    problems = [hit for path in FAMILY_BLIND for hit in family_tests(path)]
    assert not problems, (
        "ask the drafter's context (engines/protocol.py DrafterContext) or a kind's capability "
        "instead:\n" + "\n".join(problems)
    )


def test_the_family_check_catches_planted_family_tests(tmp_path):
    planted = tmp_path / "planted_engine.py"
    planted.write_text(
        "from loopspec.engines.eagle3_context import Eagle3Context\n"
        "from loopspec.model.eagle3 import Eagle3Drafter\n"
        "\n"
        "class PlantedEngine:\n"
        "    def __init__(self, drafter):\n"
        "        self.steps_drafts = drafter is not None and drafter.cfg.kind.chain\n"
        "        self.selects = drafter.cfg.kind.selector is not None\n"
        "        self.eagle = isinstance(drafter, (Eagle3Drafter, int))\n"
        "        self.capture = drafter.cfg.kind.captured_stages  # a capability: allowed\n"
    )
    assert family_tests(planted) == [
        "planted_engine.py:1: imports loopspec.engines.eagle3_context",
        "planted_engine.py:6: reads kind.chain",
        "planted_engine.py:7: reads kind.selector",
        "planted_engine.py:8: isinstance(…, Eagle3Drafter)",
    ]


def family_prefixed(name: str) -> bool:
    return name.split("_")[0].removesuffix(".py") in {"dflash", "dflash2", "dspark", "eagle3"}


def test_a_familys_files_carry_its_name_first():
    """Every module that names a drafter family in its file name names it first (eagle3_export.py, not
    export_eagle3.py): a family's files sort together in each folder."""
    misnamed = [
        str(path.relative_to(ROOT))
        for path in source_files()
        if re.search(r"_(dflash2?|dspark|eagle3)(_|\.py$)", path.name) and not family_prefixed(path.name)
    ]
    assert not misnamed, "put the family first: " + ", ".join(misnamed)
