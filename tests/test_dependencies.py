"""Each component installs by its own extra: what its code imports (through our own modules too) is
declared in pyproject.toml's base dependencies or that extra, and the operator and the router run
without torch, numpy or transformers installed (`pip install tilert-pd[operator]` stays light)."""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
HEAVY = ("torch", "numpy", "transformers", "safetensors", "tokenizers", "vllm", "triton")

# component -> (its extra, the packages whose modules make it up)
COMPONENTS = {
    "operator": ("operator", ["tilert_operator"]),
    "router": ("router", ["tilert_serve.router"]),
    "decode": ("decode", ["tilert_serve.decode"]),
    "connector": ("connector", ["tilert_serve.pd_vllm"]),
    "tinymodel": ("tinymodel", ["tilert_serve.tinymodel"]),
    "top": ("top", ["tilert_serve.top"]),
}
# Imported, but provided by what hosts the component rather than by our extra: the byte movers
# (`transfer` extra, or the CUDA wheels in the images), TileRT itself (its CUDA image only), Triton
# (ships with CUDA torch), and vLLM for the connector that runs inside it.
HOSTED = {"mooncake", "nixl", "nixl_cu12", "tilert", "triton", "vllm"}
# Imported inside `try: ... except ImportError` with a fallback: used when present, never required
# (bcrypt: observe/server.py hashes Prometheus' password with crypt(3) without it).
OPTIONAL = {"bcrypt"}


def _dist(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def _declared(extra: str) -> set[str]:
    return {_dist(r) for r in PROJECT["dependencies"] + PROJECT["optional-dependencies"][extra]}


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return grimp.build_graph(
        "tilert_serve", "tilert_operator", include_external_packages=True, exclude_type_checking_imports=True
    )


def _external_imports(graph: grimp.ImportGraph, roots: list[str]) -> set[str]:
    ours = {m for m in graph.modules if any(m == r or m.startswith(r + ".") for r in roots)}
    upstream: set[str] = set()
    for m in ours:
        upstream |= graph.find_upstream_modules(m)
    return {m.split(".")[0] for m in upstream if not m.startswith(("tilert_serve", "tilert_operator"))}


@pytest.mark.parametrize("component", sorted(COMPONENTS))
def test_every_import_of_a_component_is_declared_by_its_extra(
    graph: grimp.ImportGraph, component: str
) -> None:
    extra, roots = COMPONENTS[component]
    dists = importlib.metadata.packages_distributions()
    declared = _declared(extra)
    missing = {}
    for top in _external_imports(graph, roots) - set(sys.stdlib_module_names) - HOSTED - OPTIONAL:
        providers = {d.lower().replace("_", "-") for d in dists.get(top, [top])}
        if not providers & declared:
            missing[top] = sorted(providers)
    assert not missing, f"{component} imports packages its extra [{extra}] does not declare: {missing}"


@pytest.mark.parametrize("component", ["operator", "router"])
def test_the_light_components_import_nothing_heavy(graph: grimp.ImportGraph, component: str) -> None:
    extra, roots = COMPONENTS[component]
    assert not _external_imports(graph, roots) & set(HEAVY)
    assert not {_dist(r) for r in PROJECT["dependencies"] + PROJECT["optional-dependencies"][extra]} & set(
        HEAVY
    )


# Runs the commands with the heavy packages made unimportable, as on a machine that never installed them.
_BLOCKED_RUN = """
import sys
class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {heavy!r}:
            raise ImportError(f"{{name}} is not installed here")
sys.meta_path.insert(0, Blocker())
from tilert_serve.cli import main
sys.exit(main({argv!r}))
"""


@pytest.mark.parametrize(
    "argv",
    [
        ["operator", "--help"],
        ["render", "-f", str(ROOT / "examples" / "tiny-cpu.yaml")],
        ["router", "--help"],
    ],
    ids=["operator", "render", "router"],
)
def test_operator_and_router_commands_run_without_torch(argv: list[str]) -> None:
    code = _BLOCKED_RUN.format(heavy=set(HEAVY), argv=argv)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip()
