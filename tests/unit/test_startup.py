"""tfdist's processes load TensorFlow with the collector paused and freeze what
the import made (tfdist/startup.py)."""

import gc
import sys

import pytest

from tfdist import startup


@pytest.fixture
def unfrozen():
    """Nothing in the permanent generation at the start; whatever the test froze
    stays frozen afterwards (harmless in a test process)."""
    enabled = gc.isenabled()
    gc.unfreeze()
    yield
    if enabled:
        gc.enable()
    else:
        gc.disable()


@pytest.mark.parametrize("enabled", [True, False])
def test_load_freezes_what_the_import_made_and_keeps_the_collector_as_it_was(unfrozen, enabled):
    sys.modules.pop("tfdist.reference", None)   # a tfdist module to import afresh
    (gc.enable if enabled else gc.disable)()
    module = startup.load("reference")
    assert module is sys.modules["tfdist.reference"]
    assert gc.get_freeze_count() > 10_000   # TensorFlow's and Keras's objects at least
    assert gc.isenabled() is enabled


def test_a_plain_import_freezes_nothing(unfrozen):
    """The control: the same import without `load` leaves the permanent
    generation empty."""
    sys.modules.pop("tfdist.reference", None)
    import tfdist.reference  # noqa: F401
    assert gc.get_freeze_count() == 0


def test_the_commands_load_tensorflow_through_it():
    """tfdist-train, tfdist-export and tfdist-plan import their TensorFlow
    modules through `startup.load`, not with a plain import."""
    import inspect

    from tfdist import app
    for main, module in ((app.main, "api"), (app.export_main, "exporting"),
                         (app.plan_main, "planner")):
        source = inspect.getsource(main)
        assert f'load("{module}")' in source and f"import {module}" not in source, main
