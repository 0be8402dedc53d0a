"""LARRY engine patch for vLLM: the LARRY scheduler, `/stats` publication, and a launcher.

Importing this package does not import vLLM. LARRY's pure score (`sal_core.larry`) and the
``/stats`` schema (`sal_core.stats`) live in the core package, shared with the gateway and the
simulator; this package imports nothing of the gateway, the simulator or the benchmarks.
"""

__version__ = "0.1.0"
