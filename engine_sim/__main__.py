"""``python -m engine_sim``: the emulator CLI (same as ``python -m engine_sim.emulator``)."""

from engine_sim.emulator import main

raise SystemExit(main())
