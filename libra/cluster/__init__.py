"""The placement layer: where a job's workers run and how their processes start.

    placement.py   worker id -> node and devices, computed once, handed out by role
    process.py     the one spawn / health / stop of child processes
    engines.py     inference engines on their slots (embedded, vLLM), one protocol
    vllm.py        vLLM server command lines and environments (and a blocking launcher)
    config.py      `[fleet.vllm]` settings

Local processes today; a Ray launcher is the second implementation of the same
protocol (docs/architecture.md).
"""
