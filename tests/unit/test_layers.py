"""The layers of pyproject.toml's import contracts hold, and each contract catches the import
it is there to refuse (the check runs in-process through import-linter, as `lint-imports`)."""

from __future__ import annotations

import copy
from pathlib import Path

import grimp
import pytest
from importlinter.application.use_cases import SUCCESS, lint_imports, read_user_options
from importlinter.configuration import configure
from importlinter.contracts.acyclic_siblings import AcyclicSiblingsContract
from importlinter.contracts.forbidden import ForbiddenContract
from importlinter.contracts.layers import LayersContract
from importlinter.domain.contract import Contract

# Plugs in import-linter's readers and graph builder, as `lint-imports` does on start.
configure()

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"
CONTRACT_TYPES: dict[str, type[Contract]] = {
    "layers": LayersContract,
    "forbidden": ForbiddenContract,
    "acyclic_siblings": AcyclicSiblingsContract,
}
LAYERS = "finsieve.app on engine | gateway on the base"
EVERY_MODULE = "every base module is in the layers contract"
POLICY = "policy code runs without torch, the engine or the gateway"
NO_CIRCLES = "no import circles between the modules of a package"


def test_the_import_contracts_hold():
    """What `lint-imports` runs; the report, with each broken import, is in the captured output."""
    names = [o["name"] for o in read_user_options(str(PYPROJECT)).contracts_options]
    assert sorted(names) == sorted([LAYERS, EVERY_MODULE, POLICY, NO_CIRCLES])
    assert lint_imports(str(PYPROJECT), cache_dir=None, no_logo=True) is SUCCESS


@pytest.fixture(scope="module")
def contracts() -> dict[str, Contract]:
    options = read_user_options(str(PYPROJECT))
    return {o["name"]: CONTRACT_TYPES[o["type"]](name=o["name"], session_options=options.session_options,
                                                contract_options=o)
            for o in options.contracts_options}


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    options = read_user_options(str(PYPROJECT)).session_options
    return grimp.build_graph(*options["root_packages"], include_external_packages=True, cache_dir=None)


@pytest.mark.parametrize(("importer", "imported", "refused_by"), [
    ("finsieve.config", "gateway.validation", LAYERS),  # the base reaching up (as config.py did)
    ("finsieve.policy.pack", "engine.model_runner", LAYERS),
    ("engine.server", "gateway.frames", LAYERS),  # engine and gateway stand beside each other
    ("gateway.server", "engine.sequence", LAYERS),
    ("gateway.officers", "finsieve.app.serve", LAYERS),
    ("finsieve.policy.masks", "torch", POLICY),
    ("finsieve.policy.schema", "transformers", POLICY),
    ("finsieve.config", "finsieve.grpc_server", NO_CIRCLES),  # the circle config.py had
    ("finsieve.policy.normalize", "finsieve.policy.pack", NO_CIRCLES),
    ("gateway.validation", "gateway.server", NO_CIRCLES),
])
def test_a_planted_import_breaks_its_contract(contracts, graph, importer, imported, refused_by):
    contract = contracts[refused_by]
    assert contract.check(copy.deepcopy(graph), verbose=False).kept  # kept before the plant
    planted = copy.deepcopy(graph)
    planted.add_import(importer=importer, imported=imported)
    assert not contract.check(planted, verbose=False).kept


def test_a_base_module_missing_from_the_layers_breaks_the_contract(contracts, graph):
    """A new module of finsieve/ must be placed in a layer (exhaustive), or it could import
    the engine unseen."""
    planted = copy.deepcopy(graph)
    planted.add_module("finsieve.newcomer")
    assert not contracts[EVERY_MODULE].check(planted, verbose=False).kept
