"""LARRY engine patch for vLLM: the LARRY scheduler, `/stats` publication, and a launcher.

Importing this package does not import vLLM: `engine_patch.larry` (the pure score) is shared
with the simulator, which runs without vLLM installed.
"""

__version__ = "0.1.0"
