"""`search-r1`: question answering with a retriever (Search-R1 on NQ + HotpotQA).

The agent reasons, issues `<search>` queries and reads the top-k passages until it has
the evidence the question needs (one hop for NQ, two for HotpotQA), then answers.
Sources of every number: docs/workloads.md, section "search-r1".
"""

from libra.sim.workloads.spec import TaskClass, ToolSpec, WorkloadSpec

SEARCH_R1 = WorkloadSpec(
    name="search-r1",
    agent="goal",
    dataset_size=79_168 + 90_447,  # Search-R1 nq_hotpotqa_train: NQ + HotpotQA train
    max_context=40_960,  # paper's max length; reference search_r1_cmlfq_qwen3_14b.yaml
    max_turns=16,
    prompt_template_tokens=230,  # Search-R1 instruction template + chat template
    tool_message_tokens=12,  # <information> ... </information> + role tags
    classes=(
        TaskClass(
            name="nq",
            weight=79_168,
            question_tokens=(12.0, 0.3),
            need=(1, 1),
            skill=(3.0, 2.0),
            p_direct=0.05,
        ),
        TaskClass(
            name="hotpotqa",
            weight=90_447,
            question_tokens=(24.0, 0.35),
            need=(2, 2),
            skill=(2.5, 2.5),
            p_direct=0.02,
        ),
    ),
    tools=(
        ToolSpec(
            name="search",
            ok_payload=(420.0, 0.12),
            error_payload=(45.0, 0.1),
            max_payload=500,
            p_error=0.15,
            p_timeout=0.01,
            latency_s=(0.25, 0.6),
            timeout_s=10.0,
        ),
    ),
    turn_tokens=1_000.0,
    first_turn=1.4,
    final_turn=0.7,
    fix_turn=0.5,
    sigma_turn=0.35,
    sigma_episode=0.3,
    sigma_task=0.3,
    miss_growth=0.12,
    read_coef=0.3,
    p_give_up=0.15,
    p_stuck=0.2,
    drift_len=0.3,
    drift_tool=0.5,
    error_halflife=20.0,
    error_floor=0.1,
)
