"""SAL gateway: a server-aware, token-aware OpenAI-compatible load balancer for vLLM fleets.

Importing this package is cheap and side-effect free. The pure contracts it routes with (the
``/stats`` schema, the policies, beta) live in `sal_core`, shared with the engine patch, the
emulator and the simulator; the gateway never imports the simulator or the benchmarks.
"""

__version__ = "0.1.0"
