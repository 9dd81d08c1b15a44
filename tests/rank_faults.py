"""A fault in one rank of an MPI job, made from outside phalanx: a ``sitecustomize`` module, which
every Python process with it on its path imports at start-up, replaces ``build_model`` on that
rank alone by a function of the test's choosing (what running out of memory, a missing device or
a hung driver does to one rank of a job). A ``sitecustomize`` it shadows still runs."""

from __future__ import annotations

import os

_SITE = """
import importlib.machinery, os, sys
if os.environ.get("OMPI_COMM_WORLD_RANK") == "{rank}":
    class Fault:
        def find_spec(self, name, path=None, target=None):
            if name != "phalanx.models.loader":
                return None
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            run = spec.loader.exec_module
            def exec_module(module):
                run(module)
                def build_model(*args, **kwargs):
{body}
                module.build_model = build_model
            spec.loader.exec_module = exec_module
            return spec
    sys.meta_path.insert(0, Fault())
# the sitecustomize this one shadows, if any, runs as it would have
import importlib.util
_here = os.path.dirname(os.path.abspath(__file__))
for _d in sys.path:
    _f = os.path.join(os.path.abspath(_d or "."), "sitecustomize.py")
    if os.path.dirname(_f) != _here and os.path.isfile(_f):
        _spec = importlib.util.spec_from_file_location("_shadowed_sitecustomize", _f)
        _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
        break
"""


def fault_in_rank_build(site_dir, rank: int, body: str) -> str:
    """Write the module to ``site_dir``; ``body`` (Python statements) runs in place of rank
    ``rank``'s ``build_model``. Returns the PYTHONPATH that puts it first."""
    os.makedirs(site_dir, exist_ok=True)
    lines = "\n".join(" " * 20 + line for line in body.strip().splitlines())
    with open(os.path.join(site_dir, "sitecustomize.py"), "w") as f:
        f.write(_SITE.format(rank=rank, body=lines))
    return os.pathsep.join([str(site_dir), os.environ.get("PYTHONPATH", "")])
