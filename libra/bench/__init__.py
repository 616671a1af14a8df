"""`libra bench NAME`: each benchmark is a module here exposing
`add_arguments(parser)` and `run(args) -> dict` (the `--json` document)."""

# NAME on the command line -> module under libra.bench (listed when the module exists).
BENCHMARKS: dict[str, str] = {
    "control-plane": "control_plane",
    "engine": "engine",
    "routing": "routing",
    "planner": "planner",
    "elastic": "elastic",
    "sandbox": "sandbox",
    "service": "service",
    "proxy": "proxy",
    "relayout": "relayout",
    "train-ab": "train_ab",
    "sim-grid": "sim_grid",
    "publish": "publish",
    "train-ray": "train_ray",
    "trainer": "trainer",
    "gpu-check": "gpu_check",
}
