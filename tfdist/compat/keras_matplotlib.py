"""Start-up: Keras's eager import of matplotlib, deferred through two private
Keras modules (`defer_keras_matplotlib`); see the package docstring
(`tfdist/compat/__init__.py`). Imports no Keras: it runs before Keras loads."""

from __future__ import annotations

import sys

from tfdist.compat._guard import _changed


# -- start-up: Keras's eager import of matplotlib -----------------------------------

# Keras's modules that import matplotlib when Keras is imported: {module: (its
# global, the matplotlib module that global holds)}.
_MATPLOTLIB_IMPORTERS = {
    "keras.src.visualization.plot_image_gallery": ("plt", "matplotlib.pyplot"),
    "keras.src.visualization.plot_bounding_box_gallery": ("patches", "matplotlib.patches"),
}


class _OnFirstUse:
    """Stands for a matplotlib module in a Keras module: imports it on first
    attribute use, so `keras.visualization.plot_*` work as before."""

    def __init__(self, name):
        self._name = name

    def __getattr__(self, attribute):
        import importlib
        return getattr(importlib.import_module(self._name), attribute)

    def __repr__(self):
        return f"<{self._name}, imported on first use (tfdist.compat.defer_keras_matplotlib)>"


class _DeferMatplotlib:
    """A meta-path finder for Keras's modules that import matplotlib; it
    removes itself once it has handled them all."""

    def __init__(self):
        self.pending = set(_MATPLOTLIB_IMPORTERS)

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.pending:
            return None
        self.pending.discard(fullname)
        if not self.pending:
            sys.meta_path.remove(self)
        import importlib.machinery
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _DeferMatplotlibLoader(spec.loader, fullname)
        return spec


class _DeferMatplotlibLoader:
    def __init__(self, loader, fullname):
        self.loader, self.fullname = loader, fullname

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        if "matplotlib" in sys.modules:   # imported already: nothing to save
            self.loader.exec_module(module)
            return
        sys.modules["matplotlib"] = None   # its imports raise ImportError
        try:
            self.loader.exec_module(module)
        finally:
            if "matplotlib" in sys.modules and sys.modules["matplotlib"] is None:
                del sys.modules["matplotlib"]
        attribute, name = _MATPLOTLIB_IMPORTERS[self.fullname]
        if getattr(module, attribute, 0) is not None:
            raise _changed(f"{self.fullname}.{attribute}",
                           "is no longer None when matplotlib cannot be imported")
        setattr(module, attribute, _OnFirstUse(name))


def defer_keras_matplotlib() -> None:
    """Keep `import keras` (which `import tensorflow` does) from importing
    matplotlib until a Keras plot function uses it.

    What: two private Keras modules, `keras.src.visualization.plot_image_gallery`
    (`import matplotlib.pyplot as plt`) and `...plot_bounding_box_gallery`
    (`from matplotlib import patches`), import matplotlib when Keras is
    imported, falling back to None without it. A meta-path finder (removed
    once both are loaded) executes each with matplotlib made unimportable,
    then sets that global to a stand-in that imports the module on first
    attribute use. Why: tfdist installs matplotlib (`tfdist-compare`'s PNG),
    and its import cost 0.4-0.5 of the ~3.4 CPU-seconds of `import tensorflow`
    here (AMD EPYC, AVX-512), in every process of every run. Verified: keras
    3.15.1 (the modules in keras/src that import matplotlib at import time).
    Check: each global is None when matplotlib cannot be imported (else
    `UpstreamChanged`); tests/integration/test_compat_processes.py checks that
    nothing else imports matplotlib. A no-op when Keras is already imported.
    """
    if "keras" in sys.modules or any(isinstance(f, _DeferMatplotlib) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _DeferMatplotlib())
