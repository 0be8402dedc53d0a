"""SAL gateway: a server-aware, token-aware OpenAI-compatible load balancer for vLLM fleets.

Importing this package is cheap and side-effect free: the pure decision modules
(`policies`, `stats`, `beta`) are imported by the engine patch, the emulator and the
simulator, which must not pull in FastAPI or httpx.
"""

__version__ = "0.1.0"
