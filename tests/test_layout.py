"""The layout holds: imports run one way, kernels stand alone, functions fit a screen, docs live
in the repo, and a non-editable install ships `colocate.kernels` but not the benchmarks."""
import ast
import collections
import glob
import os
import re
import subprocess
import sys

import pytest

from tests.conftest import REPO

MAX_FUNCTION_LINES = 60


def python_files(*folders: str) -> list[str]:
    out = []
    for folder in folders:
        for root, _, files in os.walk(os.path.join(REPO, folder)):
            out += [os.path.join(root, f) for f in files if f.endswith(".py")]
    return sorted(out)


def module_name(path: str) -> str:
    rel = os.path.relpath(path, REPO)[:-3].split(os.sep)
    if rel[0] == "kernels":  # installed as colocate.kernels
        rel = ["colocate"] + rel
    if rel[-1] == "__init__":
        rel = rel[:-1]
    return ".".join(rel)


def resolve(module: str, path: str, node: ast.ImportFrom) -> str:
    """The absolute module an `import from` names (relative imports resolved)."""
    if node.level == 0:
        return node.module or ""
    package = module.split(".") if path.endswith("__init__.py") else module.split(".")[:-1]
    package = package[:len(package) - (node.level - 1)]
    return ".".join(package + ([node.module] if node.module else []))


def import_graph() -> dict[str, set[str]]:
    """Module of colocate/, kernels/ or benchmarks/ -> the modules of those it imports (at any depth)."""
    files = {module_name(p): p for p in python_files("colocate", "kernels", "benchmarks")}
    graph: dict[str, set[str]] = {m: set() for m in files}
    for module, path in files.items():
        for node in ast.walk(ast.parse(open(path).read())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):  # `from pkg import sub` names the submodule, not pkg's body
                base = resolve(module, path, node)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            for t in targets:
                while t and t not in files:  # `from colocate.x import name` -> colocate.x
                    t = t.rpartition(".")[0]
                if t and t != module:
                    graph[module].add(t)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if state.get(nxt) is None and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for n in sorted(graph):
        if state.get(n) is None and (found := visit(n)):
            return found
    return None


def test_import_graph_has_no_circle():
    assert find_cycle(import_graph()) is None, " -> ".join(find_cycle(import_graph()))


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    assert find_cycle({"p": {"p.x"}, "p.x": {"p.y"}, "p.y": {"p"}}) == ["p", "p.x", "p.y", "p"]


def upward_arrows(graph: dict[str, set[str]]) -> list[str]:
    """Arrows from a module to a package that holds it: a package's `__init__` sits above its
    modules (it is the package's front door, e.g. `envs.BUILTIN`, `make_env`), so a module inside
    imports its siblings directly, never the package back (`from pkg import sub` names `sub`)."""
    return sorted(f"{m} -> {i}" for m, imports in graph.items() for i in imports if m.startswith(i + "."))


def test_no_module_imports_the_package_above_it():
    """Inside a package the imports run one way too: no circle among siblings (the test above,
    packages included) and no arrow back up to the package itself."""
    assert upward_arrows(import_graph()) == []


def test_upward_arrows_finds_one():
    graph = {"p": {"p.a"}, "p.a": {"p.b"}, "p.b": {"p"}, "q.c": {"p.a"}}
    assert upward_arrows(graph) == ["p.b -> p"]


def test_rollout_and_learner_never_import_each_other():
    graph = import_graph()
    for module, imports in graph.items():
        for side, other in (("colocate.rollout", "colocate.learner"), ("colocate.learner", "colocate.rollout")):
            if module.startswith(side):
                assert not [i for i in imports if i.startswith(other)], (module, imports)


def test_kernels_import_nothing_of_colocate():
    for module, imports in import_graph().items():
        if module.startswith("colocate.kernels"):
            assert all(i.startswith("colocate.kernels") for i in imports), (module, imports)


def test_config_sits_at_the_bottom():
    graph = import_graph()
    assert graph["colocate.config_schema"] == set()
    assert graph["colocate.config_checks"] <= {"colocate.config_schema"}
    assert graph["colocate.config"] <= {"colocate.config_schema", "colocate.config_checks"}


def test_train_is_the_composition_root_only():
    """train.py builds each rank's parts and runs its loop; launch checks live in launch.py, the
    policy in models.py, so nothing imports it (torchrun starts it by name, for `colocate train` too)."""
    importers = sorted(m for m, imports in import_graph().items() if "colocate.train" in imports)
    assert importers == [], importers
    assert len(open(os.path.join(REPO, "colocate", "train.py")).read().splitlines()) < 200


def test_no_function_over_sixty_lines():
    long = []
    for path in python_files("colocate", "kernels", "benchmarks", "scripts"):
        for node in ast.walk(ast.parse(open(path).read())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            is_kernel = any("jit" in ast.unparse(d) for d in node.decorator_list)  # Triton kernel sources
            size = node.end_lineno - node.lineno + 1
            if size > MAX_FUNCTION_LINES and not is_kernel:
                long.append(f"{os.path.relpath(path, REPO)}:{node.lineno} {node.name} ({size} lines)")
    assert not long, long


def env_name_branches(source: str, names) -> list[int]:
    """Lines of `source` that compare with a built-in env's name (`"dataset"`, a tuple holding one)
    or compare `env.name` with a string literal: branching on an env that the env should own."""
    def literal(node) -> bool:
        if isinstance(node, ast.Constant):
            return node.value in names
        return isinstance(node, (ast.Tuple, ast.List, ast.Set)) and any(literal(e) for e in node.elts)

    def is_env_name(node) -> bool:
        return isinstance(node, ast.Attribute) and node.attr == "name" and ast.unparse(node.value).endswith("env")

    hits = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            strings = any(isinstance(n, ast.Constant) and isinstance(n.value, str) for n in sides)
            if any(literal(n) for n in sides) or (strings and any(is_env_name(n) for n in sides)):
                hits.append(node.lineno)
    return hits


def test_no_file_outside_envs_branches_on_an_env_name():
    """Env facts live in `colocate/envs/` (each env's `check`, `preflight`, `check_resume` hooks and
    `envs.BUILTIN`): no other module compares `env.name` with a literal or names a built-in env
    in a comparison."""
    from colocate.envs import BUILTIN
    hits = []
    for path in python_files("colocate", "kernels"):
        rel = os.path.relpath(path, REPO)
        if rel.startswith(os.path.join("colocate", "envs") + os.sep):
            continue
        hits += [f"{rel}:{line}" for line in env_name_branches(open(path).read(), set(BUILTIN))]
    assert not hits, hits


def test_env_name_branches_finds_them():
    names = {"arithmetic", "diplomacy", "dataset"}
    assert env_name_branches('if cfg.env.name != "dataset":\n    pass', names) == [1]
    assert env_name_branches('x = cfg.env.name in ("arithmetic", "diplomacy")', names) == [1]
    assert env_name_branches('ok = env.name == "my_pkg.envs:MyEnv"', names) == [1]
    assert env_name_branches('ok = "dataset" == kind', names) == [1]
    assert env_name_branches('print(f"env {cfg.env.name}"); ok = cfg.env.name in BUILTIN', names) == []


MAX_PARAMETERS = 8
SIGNATURES_SET_ELSEWHERE = {
    # kernel launches: one scalar or pointer per kernel argument
    "kernels/triton_rows.py": {"grpo_rows", "_launch_triton"},
    "kernels/cuda_grpo.py": {"grpo_rows_bulk"},
    # transformers' attention interface: (module, query, key, value, attention_mask, scaling, dropout, **kw)
    "colocate/learner/packing.py": {"varlen_attention"},
    "colocate/learner/tree_attention.py": {"tree_sdpa_attention", "tree_flex_attention"},
}


def parameter_count(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Parameters a caller passes: every named one (self, cls and an autograd Function's ctx aside),
    and *args and **kwargs one each."""
    a = node.args
    names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs if x.arg not in ("self", "cls", "ctx")]
    return len(names) + (a.vararg is not None) + (a.kwarg is not None)


def test_no_function_takes_more_than_eight_parameters():
    """Settings travel as records (`LossSpec`, ...), not relayed one by one through each layer."""
    wide = []
    for path in python_files("colocate", "kernels"):
        rel = os.path.relpath(path, REPO)
        allowed = SIGNATURES_SET_ELSEWHERE.get(rel, set())
        for node in ast.walk(ast.parse(open(path).read())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            is_kernel = any("jit" in ast.unparse(d) for d in node.decorator_list)  # Triton kernel sources
            if parameter_count(node) > MAX_PARAMETERS and not is_kernel and node.name not in allowed:
                wide.append(f"{rel}:{node.lineno} {node.name} ({parameter_count(node)} parameters)")
    assert not wide, wide


def test_parameter_count_counts_what_a_caller_passes():
    tree = ast.parse("def f(self, a, /, b, *args, c, d=1, **kw): pass")
    assert parameter_count(tree.body[0]) == 6


OUTSIDE = re.compile(r"\.\./shared|DESIGN\.md|\bnotes/[\w-]+\.md|\banchors/|[Ss]ession \d+")


def tracked_text_files() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    keep = (".py", ".md", ".sh", ".yaml", ".yml", ".cu", ".txt", ".ini", ".cfg", ".toml", "")
    return [f for f in out if os.path.splitext(f)[1] in keep and not f.startswith(".git")]


@pytest.mark.skipif(not os.path.isdir(os.path.join(REPO, ".git")), reason="needs a git checkout")
def test_docs_live_in_the_repo():
    """No file refers to notes outside the clone or numbers past work periods (history: HISTORY.md)."""
    this = os.path.relpath(__file__, REPO)
    hits = []
    for rel in tracked_text_files():
        if rel in ("profiles/HISTORY.md", this) or not os.path.isfile(os.path.join(REPO, rel)):
            continue
        with open(os.path.join(REPO, rel), errors="replace") as f:
            for i, line in enumerate(f, 1):
                if OUTSIDE.search(line):
                    hits.append(f"{rel}:{i}: {line.strip()[:100]}")
    assert not hits, hits


def test_readme_is_short():
    with open(os.path.join(REPO, "README.md")) as f:
        assert len(f.readlines()) <= 300


@pytest.mark.slow
def test_non_editable_install_ships_kernels_not_benchmarks(tmp_path):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--target", str(target), REPO], check=True, cwd=tmp_path)
    probe = ("import importlib.util, colocate, colocate.kernels, colocate.kernels.reference\n"
             "assert colocate.kernels.__file__.startswith(%r), colocate.kernels.__file__\n"
             "assert importlib.util.find_spec('benchmarks') is None\n"
             "try:\n    import colocate.benchmarks\nexcept ImportError:\n    print('ok')\n") % str(target)
    env = {**os.environ, "PYTHONPATH": str(target)}
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
    assert (target / "colocate" / "kernels" / "grpo_rows_sm90.cu").is_file()


def test_the_module_map_names_every_module():
    """DEVELOPERS.md's module map names every module of colocate/: a row whose path is the module's
    folder or one above it, naming the module."""
    text = open(os.path.join(REPO, "DEVELOPERS.md")).read()
    rows = [(re.match(r"\| `([^`]+)`", line).group(1), line) for line in text.splitlines()
            if re.match(r"\| `(colocate|kernels)/", line)]
    missing = []
    for path in sorted(glob.glob(os.path.join(REPO, "colocate", "**", "*.py"), recursive=True)):
        rel = os.path.relpath(path, REPO)
        stem = os.path.basename(rel)[:-3]
        if stem == "__init__" and os.path.dirname(rel) != "colocate":
            continue  # a package's own row stands for it
        folder = os.path.dirname(rel) + "/"
        named = any(rel == key or (folder.startswith(key.split("{")[0].rpartition("/")[0] + "/")
                                   and re.search(rf"\b{re.escape(stem)}\b", row)) for key, row in rows)
        if not named:
            missing.append(rel)
    assert not missing, f"DEVELOPERS.md's module map lacks {missing}"


def test_developers_names_only_files_that_exist():
    """Every file DEVELOPERS.md names by path (`tests/test_x.py`, `colocate/envs/checks.py`, a path
    below `colocate/` in the module map) exists: its recipes and test pointers cannot go stale."""
    text = open(os.path.join(REPO, "DEVELOPERS.md")).read()
    paths = {t for t in re.findall(r"`([\w./-]+\.(?:py|md|sh|yaml|jsonl|cu))`", text) if "/" in t}
    missing = [p for p in sorted(paths) if not any(os.path.exists(os.path.join(REPO, *base, p))
                                                   for base in ((), ("colocate",)))]
    assert not missing, missing


@pytest.mark.skipif(not os.path.isdir(os.path.join(REPO, ".git")), reason="needs a git checkout")
def test_no_top_level_function_is_unreferenced():
    """Every top-level function of colocate/ and kernels/ is named somewhere besides its definition
    (code, tests, configs, scripts, docs): dead code leaves the tree."""
    words: collections.Counter = collections.Counter()
    for rel in tracked_text_files():
        if os.path.isfile(os.path.join(REPO, rel)):
            words.update(re.findall(r"[A-Za-z_]\w*", open(os.path.join(REPO, rel), errors="replace").read()))
    dead = []
    for path in python_files("colocate", "kernels"):
        for node in ast.parse(open(path).read()).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and words[node.name] <= 1:
                dead.append(f"{os.path.relpath(path, REPO)}:{node.lineno} {node.name}")
    assert not dead, dead
