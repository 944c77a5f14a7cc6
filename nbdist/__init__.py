"""nbdist: notebook-first distributed training on ipyparallel MPI engines.

Importing nbdist is cheap and starts nothing: MPI starts at `hvd.init()` on the
engines, and the notebook side starts a cluster at the first `%%distributed` cell.
"""
__version__ = "0.1.0"


def load_ipython_extension(ipython):
    """`%load_ext nbdist`: register the %%distributed and %dist_* magics."""
    from .notebook.magics import load_ipython_extension as _load

    _load(ipython)


def unload_ipython_extension(ipython):
    """`%unload_ext nbdist`: stop the cluster and remove the magics."""
    from .notebook.magics import unload_ipython_extension as _unload

    _unload(ipython)


# The engine-side reporting API and the notebook-side table, imported on first use
# so that `import nbdist` stays cheap (no ipywidgets, no MPI).
_LAZY = {
    "report": ("rank.report", "report"),
    "progress": ("rank.report", "progress"),
    "TorchProgress": ("rank.report", "TorchProgress"),
    "last_metrics": ("notebook.progress_view", "last_metrics"),
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(f"{__name__}.{module}"), attr)
    raise AttributeError(f"module 'nbdist' has no attribute {name!r}")
