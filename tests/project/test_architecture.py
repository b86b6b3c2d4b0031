"""The layer rules of ``gpuflow.common.layers``, checked on the source by folder.

1. Imports point only down the layer list: a module imports its own layer and the ones
   below it, never one above; and no two modules import each other, round any loop.
2. Only the crossing layers (transfer/, data/) move bytes between host and device. A
   crossing is recognised in the syntax: ``.item()``, ``.cpu()``, ``.tolist()``,
   ``.numpy()``, ``.pin_memory()``; ``.to(...)`` given a device (an argument that names a
   device, cuda or cpu, and no dtype); ``copy_`` from a tensor built from host data; and
   ``torch.tensor(..., device=...)``. Each exception is named below with its reason.

Both checks are also run on planted violations, so that a checker that finds nothing
fails too.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from gpuflow.common.layers import CROSSING, LAYERS
from tests.helpers import PACKAGE, ROOT

SOURCE = PACKAGE

# Crossings allowed outside transfer/ and data/, and why: a path (relative to src/gpuflow),
# or "path::crossing" for one kind of crossing in one module.
CROSSING_ALLOWED = {
    "bench/baselines/": "the pipelines gpuflow replaces cross the bus the way they always did",
    "device/linkprobe.py": "measures the link by copying across it",
    "bench/transfer.py": "times the PyTorch idioms it compares the transfer layer with",
    "bench/loaders.py": "times the loading idioms DeviceLoader replaces, and their .to()",
    "bench/images.py": "times the DataLoader + .to() loop that a resident dataset replaces",
    "bench/io.py": "times memmap + .to(), the idiom kvikio and the pinned reads compete with",
    "bench/checkpoint.py": "times the usual checkpoint save (every tensor .cpu()) as a baseline",
    "device/managed.py::torch.as_tensor(..., device=...)": "wraps managed memory: no copy",
    "train/run_state.py::.numpy()": "encode_tensor's RNG states, which live on the host",
    "train/distributed.py::.item()": "agree's and least's host tensors, all-reduced over gloo",
    "train/distributed.py::.tolist()": "largest's host tensor, all-reduced over gloo",
}
HOST_BUILT = {"tensor", "as_tensor", "from_numpy"}
READS = {"item", "cpu", "tolist", "numpy", "pin_memory"}
NAMES_A_DEVICE = re.compile(r"device|cuda|\bcpu\b|\bdev\b")


def layer_of(relative: Path) -> str:
    """A module's layer: its folder; files beside the folders (``__init__``, ``__main__``)
    are the package's front door and sit on top."""
    return relative.parts[0] if len(relative.parts) > 1 else LAYERS[-1]


def _imported_layers(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            parts = node.module.split(".")
            if parts[0] != "gpuflow":
                continue
            if len(parts) > 1:
                found.append((node.lineno, parts[1]))
            else:  # from gpuflow import transfer, ...
                found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "gpuflow" and len(parts) > 1:
                    found.append((node.lineno, parts[1]))
    return found


def upward_imports(root: Path) -> list[str]:
    """Every import of a layer above the importing module's, as "path:line: a -> b"."""
    rank = {layer: i for i, layer in enumerate(LAYERS)}
    wrong = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        own = layer_of(relative)
        for line, target in _imported_layers(ast.parse(path.read_text())):
            if target in rank and rank[target] > rank[own]:
                wrong.append(f"{relative}:{line}: {own} imports {target}")
    return wrong


def _module_name(root: Path, path: Path) -> str:
    parts = ("gpuflow", *path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_cycles(root: Path) -> list[list[str]]:
    """Groups of gpuflow modules that import each other, directly or round a loop: every
    import in a module counts (inside functions and ``TYPE_CHECKING`` blocks too), so that
    no two modules need each other to be understood."""
    modules = {_module_name(root, path): path for path in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found |= {node.module} & modules.keys()
                found |= {f"{node.module}.{a.name}" for a in node.names} & modules.keys()
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names} & modules.keys()
        graph[name] = found - {name}
    # Tarjan's strongly connected components: each of more than one module is a cycle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while (w := stack.pop()) != v:
                group.append(w)
            if group:
                cycles.append(sorted([v, *group]))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def _crossing(node: ast.Call, source: str) -> str | None:
    func = node.func
    if isinstance(func, ast.Attribute):
        if func.attr in READS:
            return f".{func.attr}()"
        if func.attr == "to":
            given = [*node.args, *(k.value for k in node.keywords if k.arg == "device")]
            for arg in given:
                text = ast.get_source_segment(source, arg) or ""
                if NAMES_A_DEVICE.search(text) and "dtype" not in text:
                    return f".to({text})"
        if func.attr == "copy_" and node.args:
            src = node.args[0]
            if (
                isinstance(src, ast.Call)
                and isinstance(src.func, ast.Attribute)
                and src.func.attr in HOST_BUILT
            ):
                return "copy_ from host data"
        if func.attr in ("tensor", "as_tensor") and any(k.arg == "device" for k in node.keywords):
            return f"torch.{func.attr}(..., device=...)"
    return None


def crossings_outside_their_layers(root: Path, allowed: dict[str, str]) -> list[str]:
    """Every crossing in a module outside ``CROSSING`` and ``allowed``."""
    wrong = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if layer_of(relative) in CROSSING or any(
            str(relative).startswith(prefix) for prefix in allowed
        ):
            continue
        source = path.read_text()
        for node in ast.walk(ast.parse(source)):
            what = isinstance(node, ast.Call) and _crossing(node, source)
            if what and f"{relative}::{what}" not in allowed:
                wrong.append(f"{relative}:{node.lineno}: {what}")
    return wrong


def test_the_folders_are_the_layers():
    folders = {p.name for p in SOURCE.iterdir() if p.is_dir() and not p.name.startswith("_")}
    assert folders == set(LAYERS)
    loose = {p.name for p in SOURCE.glob("*.py")}
    assert loose == {"__init__.py", "__main__.py"}  # everything else lives in a layer


def test_imports_point_only_down_the_layer_list():
    assert upward_imports(SOURCE) == []


def test_no_two_modules_import_each_other():
    assert import_cycles(SOURCE) == []


def test_the_cycle_check_finds_a_planted_cycle(tmp_path):
    _plant(tmp_path, "train/a.py", "from gpuflow.train.b import B\n")
    _plant(tmp_path, "train/b.py", "def f():\n    from gpuflow.train.c import C\n")
    _plant(tmp_path, "train/c.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
           "    from gpuflow.train.a import A\n")  # fmt: skip
    _plant(tmp_path, "train/d.py", "from gpuflow.train.a import A\n")
    assert import_cycles(tmp_path) == [["gpuflow.train.a", "gpuflow.train.b", "gpuflow.train.c"]]


def test_only_the_transfer_and_data_layers_cross_the_bus():
    assert crossings_outside_their_layers(SOURCE, CROSSING_ALLOWED) == []
    for allowed in CROSSING_ALLOWED:  # an exception that no longer applies is removed
        assert (SOURCE / allowed.split("::")[0]).exists(), allowed


def _plant(root: Path, relative: str, text: str) -> None:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.mark.parametrize(
    ("relative", "text"),
    [
        ("model/gpt.py", "from gpuflow.train.config import TrainConfig\n"),
        ("data/shards.py", "import gpuflow.interface.cli\n"),
        ("accounting/tally.py", "from gpuflow import transfer\n"),
        ("train/datapath.py", "def rows():\n    from gpuflow.bench.baselines import naive\n"),
    ],
)
def test_the_import_check_finds_a_planted_upward_import(tmp_path, relative, text):
    _plant(tmp_path, relative, text)
    _plant(tmp_path, "train/ok.py", "from gpuflow.model.gpt import GPT\n")
    assert len(upward_imports(tmp_path)) == 1


def test_the_bench_sits_above_every_layer_a_training_run_loads():
    """So the import check keeps the bench's code, its baselines included, out of them."""
    product = ("common", "device", "accounting", "transfer", "data", "model", "train")
    assert all(LAYERS.index(layer) < LAYERS.index("bench") for layer in product)


@pytest.mark.parametrize(
    "line",
    [
        "print(loss.item())",
        "x = batch.to(device.torch, non_blocking=True)",
        "x = batch.to(device='cuda')",
        "table.copy_(torch.tensor(addresses))",
        "t = torch.tensor([1, 2], device=model_device)",
        "host = grads.cpu()",
        "pinned = x.pin_memory()",
    ],
)
def test_the_crossing_check_finds_a_planted_crossing(tmp_path, line):
    _plant(tmp_path, "train/step.py", f"def step(loss, batch, device, model_device):\n    {line}\n")
    assert len(crossings_outside_their_layers(tmp_path, {})) == 1


def test_the_baselines_exception_covers_their_folder_and_no_other_bench(tmp_path):
    crossing = "def f(loss):\n    return loss.item()\n"
    _plant(tmp_path, "bench/baselines/naive.py", crossing)
    _plant(tmp_path, "bench/results.py", crossing)
    found = crossings_outside_their_layers(tmp_path, CROSSING_ALLOWED)
    assert found == ["bench/results.py:2: .item()"]


def test_the_crossing_check_leaves_casts_and_same_device_copies_alone(tmp_path):
    _plant(
        tmp_path,
        "model/head.py",
        "def f(h, w, dtype, lr, rate):\n"
        "    h = h.to(dtype)\n"
        "    w = w.to(torch.get_autocast_dtype(device_type))\n"
        "    lr.copy_(rate)\n",
    )
    _plant(tmp_path, "transfer/loader.py", "def g(x, device):\n    return x.to(device)\n")
    assert crossings_outside_their_layers(tmp_path, {}) == []


def test_type_checkers_see_every_public_name_and_dir_lists_them():
    import gpuflow

    tree = ast.parse((SOURCE / "__init__.py").read_text())
    guarded = next(n for n in tree.body if isinstance(n, ast.If))  # if TYPE_CHECKING:
    seen = {alias.name for node in guarded.body for alias in node.names}
    assert seen == set(gpuflow._EXPORTS)
    assert set(gpuflow._EXPORTS) <= set(dir(gpuflow))
    for name, module in gpuflow._EXPORTS.items():
        assert getattr(gpuflow, name).__module__ == module


def private_gpuflow_names(folder: Path) -> list[str]:
    """``file:line name`` for each private gpuflow name a script imports or reads off a
    gpuflow module (``from gpuflow.x import _y``, ``x._y`` where ``x`` came from gpuflow)."""
    found = []
    for path in sorted(folder.glob("*.py")):
        tree = ast.parse(path.read_text())
        modules = set()  # names bound to gpuflow modules in this script
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gpuflow"):
                for alias in node.names:
                    if alias.name.startswith("_"):
                        found.append(f"{path.name}:{node.lineno} {alias.name}")
                    modules.add(alias.asname or alias.name)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("gpuflow"):
                        modules.add(alias.asname or alias.name.split(".")[0])
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and isinstance(node.value, ast.Name)
                and node.value.id in modules
            ):
                found.append(f"{path.name}:{node.lineno} {node.value.id}.{node.attr}")
    return found


def test_no_probe_reaches_for_a_private_gpuflow_name():
    assert private_gpuflow_names(ROOT / "benchmarks" / "probes") == []


def test_the_private_name_check_finds_planted_uses(tmp_path):
    (tmp_path / "probe.py").write_text(
        "from gpuflow.train import sharded\nfrom gpuflow.bench.loaders import _train\n"
        "sharded._shared = None\nimport torch\ntorch._dynamo.reset()\n"
    )
    assert private_gpuflow_names(tmp_path) == ["probe.py:2 _train", "probe.py:3 sharded._shared"]
