"""`dapo-math`: competition math (DAPO-Math-17K) with a Python interpreter.

Most episodes are one long reasoning turn that ends in an answer; some call Python to
check a computation (an exception brings a fix turn, a timeout a retry). Lengths are
heavy-tailed and many episodes run into the length limit. Sources: docs/workloads.md,
section "dapo-math".
"""

from libra.sim.workloads.spec import TaskClass, ToolSpec, WorkloadSpec

DAPO_MATH = WorkloadSpec(
    name="dapo-math",
    agent="goal",
    dataset_size=17_000,  # DAPO-Math-17K
    max_context=32_768,  # reference dapo_math_cmlfq_qwen3_4b.yaml max_seq_length
    max_turns=6,
    prompt_template_tokens=90,  # DAPO's "Solve the following math problem..." wrapper
    tool_message_tokens=10,
    classes=(
        TaskClass(
            name="math",
            weight=1.0,
            question_tokens=(80.0, 0.6),
            need=(1, 1),
            skill=(2.0, 2.0),
            p_direct=0.6,
        ),
    ),
    tools=(
        ToolSpec(
            name="python",
            ok_payload=(40.0, 0.8),
            error_payload=(250.0, 0.6),
            max_payload=1_600,
            p_error=0.2,
            p_timeout=0.03,
            latency_s=(0.8, 0.8),
            timeout_s=10.0,
        ),
    ),
    turn_tokens=1_200.0,
    first_turn=3.0,
    final_turn=0.5,
    fix_turn=0.6,
    sigma_turn=0.6,
    sigma_episode=0.5,
    sigma_task=0.6,
    miss_growth=0.15,
    read_coef=0.5,
    p_give_up=0.3,
    p_stuck=0.1,
    drift_len=0.2,
    drift_tool=0.3,
    error_halflife=40.0,
    error_floor=0.2,
)
