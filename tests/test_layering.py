"""The package layering (docs/architecture.md): a package imports only from the floors below
it. Walks every import in src/tailserve with ``ast`` (inside functions and TYPE_CHECKING
blocks too) and fails on an import that goes up or sideways where the layering forbids it."""

from __future__ import annotations

import ast
import pathlib

import pytest

SRC = pathlib.Path(__file__).resolve().parent.parent / "src" / "tailserve"

# Floor 0 (plain data): modules directly under tailserve/ that any package may import.
FLOOR0 = {"config", "errors", "sampling_params", "platform_info"}

# package -> tailserve packages it must never import.
FORBIDDEN = {
    "kernels": {"model", "attention", "sample", "memory", "speculative", "metrics", "engine", "server", "bench",
                "structured", "integrations", "cli"},
    "sample": {"model", "attention", "memory", "speculative", "metrics", "engine", "server", "bench", "structured",
               "cli"},
    "memory": {"engine", "speculative", "server", "bench", "cli"},
    "speculative": {"engine", "server", "bench", "cli"},
    "attention": {"model", "engine", "speculative", "server", "bench", "cli"},
    "metrics": {"memory", "engine", "speculative", "model", "attention", "server", "bench", "cli"},
    "model": {"engine", "speculative", "server", "bench", "cli"},
    "engine": {"server", "bench", "cli"},
    # Grammars and tool-call parsers: plain data and llguidance, below the engine.
    "structured": {"engine", "server", "bench", "model", "attention", "memory", "speculative", "metrics", "cli"},
    # The load generator speaks only HTTP (its tokenizer is model/tokenizer.py's wrapper).
    "bench": {"engine", "server", "attention", "memory", "speculative", "sample", "kernels"},
    # The demo drives the server over HTTP (a child process) and the engine in process.
    "demo": {"server", "cli"},
}


def _imports(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, imported tailserve package) for every import in the file."""
    tree = ast.parse(path.read_text(), str(path))
    here = path.relative_to(SRC.parent).with_suffix("").parts  # ("tailserve", "engine", "worker")
    out = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = list(here[: len(here) - node.level])
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            names = [mod] if node.module else [f"{mod}.{a.name}" for a in node.names]
            if mod == "tailserve":
                names = [f"tailserve.{a.name}" for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "tailserve" and len(parts) > 1:
                out.append((node.lineno, parts[1]))
    return out


def _violations() -> list[str]:
    bad = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC)
        if len(rel.parts) < 2:
            continue  # floor-0 modules and the CLI at the top
        pkg = rel.parts[0]
        for line, target in _imports(path):
            if target in FORBIDDEN.get(pkg, set()):
                bad.append(f"{rel}:{line} imports tailserve.{target} ({pkg} may not import {target})")
    return bad


def test_no_package_imports_above_its_floor() -> None:
    assert _violations() == []


def test_floor0_modules_import_only_floor0() -> None:
    # config.py validates --cuda-alloc-conf with the allocator's parser, itself plain parsing
    # that imports nothing above floor 0 (checked here too).
    allowed = FLOOR0 | {"memory"}
    bad = []
    for name in [*FLOOR0, "memory/allocator/conf"]:
        for line, target in _imports(SRC / f"{name}.py"):
            if target not in (FLOOR0 if name.startswith("memory") else allowed):
                bad.append(f"{name}.py:{line} imports tailserve.{target}")
    assert bad == []


def test_the_walker_sees_function_level_and_type_checking_imports(tmp_path: pathlib.Path) -> None:
    # A negative control: an upward import hidden in a function or a TYPE_CHECKING block is found.
    src = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from tailserve.engine.scheduler import S\n" \
          "def f():\n    import tailserve.memory.block_pool\n    from tailserve import engine\n"
    (tmp_path / "tailserve" / "memory").mkdir(parents=True)
    p = tmp_path / "tailserve" / "memory" / "x.py"
    p.write_text(src)
    global SRC
    saved, SRC = SRC, tmp_path / "tailserve"
    try:
        assert [t for _, t in _imports(p)] == ["engine", "memory", "engine"]
        assert len(_violations()) == 2
    finally:
        SRC = saved


HOT_PATH = ["model/llama.py", "attention/reference.py", "attention/cpu_decode.py", "attention/backend.py",
            "engine/model_runner.py", "sample/sampler.py", "sample/rejection.py", "speculative/proposer.py"]


@pytest.mark.parametrize("module", HOT_PATH)
def test_hot_path_does_not_sniff_its_platform(module: str) -> None:
    """The plan decides at load time; a step never re-detects it (``hasattr`` on metadata,
    ``isinstance`` on the proposer)."""
    text = (SRC / module).read_text()
    for needle in ("hasattr(meta", "isinstance(self.proposer", "isinstance(proposer"):
        assert needle not in text, f"{module} has {needle!r}"


# Functions of the hot-path modules that run at load time, where a device check belongs.
LOAD_TIME = {"__init__", "__post_init__", "capture", "capture_decode_graphs", "warm_up", "upcasts_attention"}


def _device_type_checks(path: pathlib.Path) -> list[str]:
    """``<x>.device.type`` / ``device.type`` / ``dev.type`` read inside a function that runs
    per step (anything but the load-time functions above)."""
    tree = ast.parse(path.read_text(), str(path))
    found = []

    def visit(node: ast.AST, func: str | None) -> None:
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef) else func
            if isinstance(child, ast.Attribute) and child.attr == "type" and func not in LOAD_TIME and func:
                v = child.value
                if (isinstance(v, ast.Attribute) and v.attr == "device") or (
                        isinstance(v, ast.Name) and v.id in ("device", "dev")):
                    found.append(f"{path.name}:{child.lineno} in {func}()")
            visit(child, name)

    visit(tree, None)
    return found


def test_hot_path_has_no_per_step_device_branch() -> None:
    bad = [hit for module in HOT_PATH for hit in _device_type_checks(SRC / module)]
    assert bad == []


def test_the_device_check_finder_sees_one(tmp_path: pathlib.Path) -> None:
    p = tmp_path / "m.py"
    p.write_text("class A:\n    def __init__(self, d):\n        self.cpu = d.device.type == 'cpu'\n"
                 "    def step(self, x):\n        return x.device.type == 'cpu'\n")
    assert _device_type_checks(p) == ["m.py:5 in step()"]
