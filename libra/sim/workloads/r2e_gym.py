"""`r2e-gym`: repository repair in a sandbox (R2E-Gym with file editor, search, bash).

The agent explores the repository, reproduces the bug, then edits and re-runs the tests
until they pass. Failing runs return long logs (tool `error`, non-zero exit) that the
next turn diagnoses; viewing files returns large payloads. Sources: docs/workloads.md,
section "r2e-gym".
"""

from libra.sim.workloads.spec import TaskClass, ToolSpec, WorkloadSpec

R2E_GYM = WorkloadSpec(
    name="r2e-gym",
    agent="swe",
    dataset_size=8_101,  # R2E-Gym v1 train split (reference data/r2e_gym_v1 card)
    max_context=40_960,  # the paper's max length (DESIGN.md)
    max_turns=40,  # R2E-Gym agent step budget
    prompt_template_tokens=1_100,  # system prompt with the four tools' docs
    tool_message_tokens=10,
    classes=(
        TaskClass(
            name="one-fix", weight=0.60, question_tokens=(350.0, 0.6), need=(1, 1), skill=(4.0, 1.5)
        ),
        TaskClass(
            name="iterate", weight=0.28, question_tokens=(450.0, 0.6), need=(2, 2), skill=(3.0, 2.0)
        ),
        TaskClass(
            name="hard", weight=0.12, question_tokens=(550.0, 0.6), need=(3, 4), skill=(1.5, 2.5)
        ),
    ),
    tools=(
        ToolSpec(
            name="search",
            weight=1.0,
            ok_payload=(150.0, 0.9),
            error_payload=(60.0, 0.3),
            max_payload=4_000,
            p_error=0.05,
            p_timeout=0.005,
            latency_s=(0.4, 0.5),
            timeout_s=30.0,
        ),
        ToolSpec(
            name="view",
            call="file_editor",
            ok_payload=(400.0, 1.1),
            error_payload=(60.0, 0.3),
            max_payload=16_000,
            p_error=0.05,
            p_timeout=0.0,
            latency_s=(0.2, 0.5),
            timeout_s=30.0,
        ),
        ToolSpec(
            name="edit",
            call="file_editor",
            ok_payload=(200.0, 0.5),
            error_payload=(80.0, 0.3),
            max_payload=2_000,
            p_error=0.15,
            p_timeout=0.0,
            latency_s=(0.2, 0.5),
            timeout_s=30.0,
        ),
        ToolSpec(
            name="bash",
            call="execute_bash",
            ok_payload=(100.0, 0.8),
            error_payload=(400.0, 1.3),
            max_payload=16_000,
            p_error=0.05,
            p_timeout=0.03,
            latency_s=(4.0, 1.0),
            timeout_s=300.0,
        ),
    ),
    turn_tokens=170.0,
    first_turn=2.0,
    final_turn=0.5,
    fix_turn=1.2,
    sigma_turn=0.7,
    sigma_episode=0.45,
    sigma_task=0.6,
    miss_growth=0.2,
    read_coef=0.5,
    p_give_up=0.15,
    p_stuck=0.3,
    drift_len=0.3,
    drift_tool=0.3,
    error_halflife=30.0,
    error_floor=0.3,
)
