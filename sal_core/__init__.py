"""SAL's pure contracts, shared by the gateway, the engine patch, the emulator and the simulator.

The bottom layer: `stats` (the ``GET /stats`` schema), `larry` (LARRY's ordering), `policies`
(routing policy data types, the policies, their registry), `beta` (SAL's beta estimator) and
`percentile` (the one percentile definition every report uses). Standard library only; it
imports nothing else of ours (tests/unit/test_layers.py checks it), so importing it never pulls
in vLLM, FastAPI or httpx.
"""

__version__ = "0.1.0"
