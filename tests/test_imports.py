"""The house rule on imports: they only point down the layers below, and never close a circle.

Every module of flashformer/ and kernels/ (installed as flashformer.kernels) is parsed with ast, so the
check also sees imports inside functions (imported lazily, they are still dependencies). Imports under
``if TYPE_CHECKING:`` are left out: they never run. A module may import only from layers below its own.
ARCHITECTURE.md lists the same layers; a new module needs a layer here before the test passes.
"""

import ast
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = {"flashformer": os.path.join(ROOT, "flashformer"), "flashformer.kernels": os.path.join(ROOT, "kernels")}

# Top to bottom; "flashformer" and "flashformer.kernels" are the packages' __init__.py. Modules in one
# layer do not import one another.
LAYERS = [
    ("command line", ["flashformer.cli"]),
    ("long-context recipe: public names", ["flashformer.longctx"]),
    ("long-context recipe: the command", ["flashformer.longctx.run"]),
    ("long-context recipe: extension, evaluation, report",
     ["flashformer.longctx.extend", "flashformer.longctx.evaluate", "flashformer.longctx.report"]),
    ("long-context recipe: passkey data", ["flashformer.longctx.passkey"]),
    ("training: public names", ["flashformer.train"]),
    ("training loop", ["flashformer.train.loop"]),
    ("training: the model a run trains, the run directory",
     ["flashformer.train.model_setup", "flashformer.train.run_dir"]),
    ("training: config, step, checkpoints and lock, signals, metrics",
     ["flashformer.train.config", "flashformer.train.step", "flashformer.train.state", "flashformer.train.stops",
      "flashformer.train.metrics"]),
    ("training batches", ["flashformer.batches"]),
    ("around the model: parallelism, generation, memory plans",
     ["flashformer.parallel", "flashformer.context_parallel", "flashformer.generate", "flashformer.memory"]),
    ("context parallelism: the zigzag layout, the ring's attention calls", ["flashformer.zigzag"]),
    ("public loading API", ["flashformer"]),
    ("tokenizers", ["flashformer.tokenizer"]),
    ("loading checkpoints into models", ["flashformer.checkpoint"]),
    ("LoRA adapters", ["flashformer.lora"]),
    ("model", ["flashformer.model"]),
    ("the sampling loop", ["flashformer.sampling"]),
    ("checkpoint files", ["flashformer.weights"]),
    ("Hugging Face translation", ["flashformer.hf"]),
    ("model config", ["flashformer.model_config"]),
    ("chat data", ["flashformer.chat"]),
    ("model parts, data",
     ["flashformer.attention", "flashformer.losses", "flashformer.rope", "flashformer.data", "flashformer.profiling",
      "flashformer.layers", "flashformer.families"]),
    ("configs", ["flashformer.config"]),
    ("crash-safe writes", ["flashformer.fileio"]),
    ("kernels: public API", ["flashformer.kernels"]),
    ("kernels: entry points", ["flashformer.kernels.flash_attn", "flashformer.kernels.cross_entropy"]),
    ("kernels: the kv-cache entry point", ["flashformer.kernels.kvcache"]),
    ("kernels: packed queries over a kv cache", ["flashformer.kernels.kvcache_packed"]),
    ("kernels: rotary and the append at cache positions", ["flashformer.kernels.cache_append"]),
    ("kernels: varlen over paged k/v", ["flashformer.kernels.varlen_kv"]),
    ("kernels: the kv-cache entry point's checks", ["flashformer.kernels.kvcache_checks"]),
    ("kernels: path choice, autograd", ["flashformer.kernels.interface"]),
    ("kernels: the backward compiled during the forward", ["flashformer.kernels.compile_ahead"]),
    ("kernels: cache pages, rotary at cache positions", ["flashformer.kernels.cache_pages"]),
    ("kernels: argument checks", ["flashformer.kernels.checks"]),
    ("kernels: backward, decoding", ["flashformer.kernels.flash_bwd", "flashformer.kernels.decode"]),
    ("kernels: the decode kernels' bodies", ["flashformer.kernels.decode_kernels"]),
    ("kernels: forward", ["flashformer.kernels.flash_fwd"]),
    ("kernels: Hopper backward in Gluon: dQ", ["flashformer.kernels.flash_bwd_dq_hopper"]),
    ("kernels: Hopper backward in Gluon: dK/dV", ["flashformer.kernels.flash_bwd_hopper"]),
    ("kernels: Hopper backward in Gluon: the dK/dV producer", ["flashformer.kernels.flash_bwd_hopper_load"]),
    ("kernels: Hopper backward in Gluon: the dQ share's bulk reduction", ["flashformer.kernels.dq_reduce_hopper"]),
    ("kernels: Hopper forward in Gluon", ["flashformer.kernels.flash_fwd_hopper"]),
    ("kernels: Hopper forward in Gluon: a consumer's query tile, the producer",
     ["flashformer.kernels.flash_fwd_hopper_tile", "flashformer.kernels.flash_fwd_hopper_load"]),
    ("kernels: Gluon helpers of the Hopper kernels", ["flashformer.kernels.hopper_ops"]),
    ("kernels: the backward's row statistics", ["flashformer.kernels.bwd_stats"]),
    ("kernels: the persistent forward's tile schedule", ["flashformer.kernels.tile_schedule"]),
    ("kernels: tile-shape policy, launch mechanics", ["flashformer.kernels.tuning", "flashformer.kernels.launch"]),
    ("kernels: tile helpers, PyTorch reference, packing",
     ["flashformer.kernels.tile_ops", "flashformer.kernels.reference", "flashformer.kernels.packing"]),
    ("kernels: masks, head sizes, environment variables",
     ["flashformer.kernels.masking", "flashformer.kernels.sizes", "flashformer.kernels.settings"]),
]
LAYER_OF = {module: index for index, (_, modules) in enumerate(LAYERS) for module in modules}


def _modules(packages=PACKAGES):
    """{module name: path} for every .py file of the two packages and their subpackages."""
    modules = {}
    for package, directory in packages.items():
        for filename in sorted(os.listdir(directory)):
            path = os.path.join(directory, filename)
            if filename.endswith(".py"):
                modules[package if filename == "__init__.py" else f"{package}.{filename[:-3]}"] = path
            elif os.path.isfile(os.path.join(path, "__init__.py")):
                modules.update(_modules({f"{package}.{filename}": path}))
    return modules


def _is_type_checking(node):
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(tree, package, modules):
    """The modules of ``modules`` that a module of ``package`` imports: ``from X import name`` is an edge
    to X.name when that is one of our modules (a submodule), else to X."""
    found = set()

    def visit(node):
        if _is_type_checking(node):
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            else:
                base = node.module
            for alias in node.names:
                target = f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                if target in modules:
                    found.add(target)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def import_graph():
    """{module: set of our modules it imports}, over flashformer/ and kernels/."""
    modules = _modules()
    graph = {}
    for module, path in modules.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
        package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
        graph[module] = _imports(tree, package, modules) - {module}
    return graph


def test_every_module_has_a_layer():
    missing = sorted(set(_modules()) - set(LAYER_OF))
    stale = sorted(set(LAYER_OF) - set(_modules()))
    assert not missing, f"modules with no layer in tests/test_imports.py (and ARCHITECTURE.md): {missing}"
    assert not stale, f"layers name modules that do not exist: {stale}"


# A module a newcomer can read in one sitting; past this it wants splitting along a seam of its own.
MAX_MODULE_LINES = 450


def test_no_module_is_longer_than_one_sitting():
    with_lengths = {module: sum(1 for _ in open(path)) for module, path in _modules().items()}
    long = {module: lines for module, lines in with_lengths.items() if lines > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_imports_point_down():
    upward = sorted((module, target) for module, targets in import_graph().items() for target in targets
                    if module in LAYER_OF and target in LAYER_OF and LAYER_OF[target] <= LAYER_OF[module])
    assert not upward, "imports that do not point down the layers:\n" + "\n".join(
        f"  {module} ({LAYERS[LAYER_OF[module]][0]}) -> {target} ({LAYERS[LAYER_OF[target]][0]})"
        for module, target in upward)


def _cycle(graph):
    """One import circle of ``graph`` as a list of modules, or None."""
    state = {}

    def visit(node, path):
        state[node] = "open"
        for target in sorted(graph.get(node, ())):
            if state.get(target) == "open":
                return path[path.index(target):] + [target]
            if target not in state:
                found = visit(target, path + [target])
                if found:
                    return found
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node, [node])
            if found:
                return found
    return None


def test_no_import_circle():
    cycle = _cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


@pytest.mark.parametrize("graph, expected", [
    ({"a": {"b"}, "b": {"c"}, "c": set()}, None),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"]),
])
def test_cycle_finder(graph, expected):
    assert _cycle(graph) == expected


def test_the_bare_name_kernels_is_the_pypi_package_even_from_the_repository_root():
    """From the root, `import kernels` finds kernels/ first; transformers imports Hugging Face's `kernels` by that name."""
    probe = ("import importlib.util, sys\n"
             "sys.path.remove('')\n"
             "spec = importlib.util.find_spec('kernels')\n"
             "print(spec.origin if spec else None)\n")
    shadowed = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    shadowed_origin = shadowed.stdout.strip()
    assert shadowed_origin != os.path.join(ROOT, "kernels", "__init__.py")
    from_root = ("import kernels\n"
                 "import flashformer.kernels\n"
                 "print(getattr(kernels, '__file__', None))\n"
                 "print(hasattr(kernels, 'flash_attn_func'), hasattr(flashformer.kernels, 'flash_attn_func'))\n")
    result = subprocess.run([sys.executable, "-c", from_root], cwd=ROOT, capture_output=True, text=True, check=True)
    origin, exports = result.stdout.split("\n")[:2]
    assert exports == "False True"
    if shadowed_origin != "None":
        assert origin == shadowed_origin
