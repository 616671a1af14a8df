"""`libra profile`: measured hardware profiles for the planner.

Times decode and prefill steps of real inference endpoints (vLLM or the embedded
engine) through their OpenAI API, and a trainer micro-step on this machine, then fits
the cost model's own terms to them (`libra.planner.fit`, pure) and writes a profile file
that `load_hardware` reads (`libra plan`, `libra simulate`, `[planner] hardware` of
`libra train`).

| module | job |
|---|---|
| `config.py` | `ProfileConfig`: endpoints, grid, held-out point, micro-step |
| `probe.py` | timed requests against one endpoint (decode pairs, prefill) |
| `trainstep.py` | the trainer micro-step, in its own process |
| `session.py` | one run: describe, measure, fit -> `ProfileResult` |
| `report.py` | the profile file (with sources), the JSON document, the text report |
| `tomlfile.py` | writing TOML |
"""

from libra.profiling.config import ProfileConfig
from libra.profiling.session import ProfileResult, run_profile

__all__ = ["ProfileConfig", "ProfileResult", "run_profile"]
