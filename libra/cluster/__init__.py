"""The placement layer: where a job's workers run and how their processes start.

    placement.py   worker id -> node and devices, computed once, handed out by role
    process.py     the one spawn / health / stop of child processes
    engines.py     inference engines on their slots (embedded, vLLM), one protocol
    vllm.py        vLLM server command lines and environments (and a blocking launcher)
    raylaunch.py   the same engines inside Ray actors on a cluster's nodes
    backend.py     which of the two starts a job's embedded engines (`[cluster] backend`)
    config.py      `[cluster]`, `[fleet.vllm]` and `[launch]` settings

Local processes by default; with `[cluster] backend = "ray"` the Ray launcher is the
second implementation of the same protocol (docs/cluster.md).
"""
