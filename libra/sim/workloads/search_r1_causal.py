"""`search-r1-causal` (version 1): Search-R1 on a web search backend, calibrated to the
per-prompt consistency the Libra paper's workload shows.

Same task mix and turn structure as `search-r1`, with a `SearchAgent`: a query the web
serves badly comes back empty (a short return the agent answers by reformulating), a
result list carries the evidence with the prompt's `skill`, and a degenerate episode
(reasoning collapsed into broken tags) emits malformed actions and runs to the limit.
Sources and the calibration targets: docs/workloads.md, section "search-r1-causal".
"""

from libra.sim.workloads.spec import TaskClass, ToolSpec, WorkloadSpec

SEARCH_R1_CAUSAL = WorkloadSpec(
    name="search-r1-causal",
    version=1,
    agent="search",
    dataset_size=79_168 + 90_447,  # Search-R1 nq_hotpotqa_train: NQ + HotpotQA train
    max_context=40_960,  # reference search_r1_cmlfq_qwen3_14b.yaml
    max_turns=16,
    prompt_template_tokens=230,
    tool_message_tokens=12,
    classes=(
        TaskClass(
            name="nq",
            weight=79_168,
            question_tokens=(12.0, 0.3),
            need=(1, 1),
            skill=(0.36, 0.18),  # mean 2/3; U-shaped: answerability is the question's
            p_direct=0.05,
        ),
        TaskClass(
            name="hotpotqa",
            weight=90_447,
            question_tokens=(24.0, 0.35),
            need=(2, 2),
            skill=(0.3, 0.21),  # mean 0.59 per hop
            p_direct=0.02,
        ),
    ),
    tools=(
        # a result list: ~10 organic results of title + snippet + link
        ToolSpec(
            name="search",
            call="search",
            ok_payload=(650.0, 0.3),
            error_payload=(45.0, 0.1),
            max_payload=1_500,
            p_error=0.04,
            p_timeout=0.01,
            latency_s=(0.8, 0.5),
            timeout_s=10.0,
        ),
        # "No results found" (weight: chance per query for a question of skill 0)
        ToolSpec(
            name="search-empty",
            call="search",
            weight=0.6,
            ok_payload=(20.0, 0.2),
            error_payload=(45.0, 0.1),
            max_payload=1_500,
            p_error=0.04,
            p_timeout=0.01,
            latency_s=(0.6, 0.5),
            timeout_s=10.0,
        ),
        # the invalid-action message (weight: chance a degenerate episode's call is malformed)
        ToolSpec(
            name="invalid",
            call="search",
            weight=0.7,
            ok_payload=(45.0, 0.1),
            error_payload=(45.0, 0.1),
            max_payload=500,
            p_error=1.0,
            p_timeout=0.0,
            latency_s=(0.01, 0.3),
            timeout_s=10.0,
        ),
    ),
    turn_tokens=970.0,
    first_turn=1.4,
    final_turn=0.7,
    fix_turn=0.5,
    sigma_turn=0.35,
    sigma_episode=0.2,
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
