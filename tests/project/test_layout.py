"""The tests mirror the package: one folder per layer of ``src/gpuflow`` (and ``project/`` for
the whole project), GPU modules named ``test_<name>_gpu.py`` beside the cpu tests of their layer
and marked ``gpu``, and helpers imported from ``tests.helpers``, never a relative conftest."""

from __future__ import annotations

import ast

from gpuflow.common.layers import LAYERS
from tests.helpers import PACKAGE, ROOT

TESTS = ROOT / "tests"


def _test_modules():
    return sorted(TESTS.rglob("test_*.py"))


def test_each_layer_has_a_folder_of_tests_and_there_is_no_other():
    layers = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert layers == set(LAYERS)
    folders = {p.name for p in TESTS.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == layers | {"project"}
    for folder in folders:
        assert (TESTS / folder / "__init__.py").exists(), folder  # unique module names


def test_test_modules_live_in_a_layer_folder():
    assert [p.name for p in _test_modules() if p.parent == TESTS] == []


def _marks_gpu(tree: ast.Module) -> bool:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets
        ):
            return "pytest.mark.gpu" in ast.unparse(node.value)
    return False


def test_gpu_modules_are_named_for_it_and_marked():
    for path in _test_modules():
        tree = ast.parse(path.read_text())
        assert _marks_gpu(tree) == path.stem.endswith("_gpu"), path.relative_to(ROOT)


def test_no_test_imports_a_conftest_or_relies_on_its_place():
    for path in [*_test_modules(), TESTS / "conftest.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert node.level == 0, f"{path.relative_to(ROOT)}: relative import"
                assert "conftest" not in (node.module or ""), path.relative_to(ROOT)
            if isinstance(node, ast.Subscript) and ast.unparse(node).startswith("Path(__file__)"):
                raise AssertionError(f"{path.relative_to(ROOT)}: a root from __file__")
