"""`libra.rollout.layouts`: verl / TRL rows mapped to an env's fields (pure)."""

from __future__ import annotations

from libra.rollout.layouts import adapt_tasks, layout

QA = ("question", "answers")


def test_search_r1_verl_row_keeps_its_target_list_and_the_original_row() -> None:
    row = {
        "data_source": "nq",
        "prompt": [{"role": "user", "content": "Answer... Question: who wrote Hamlet?"}],
        "reward_model": {"style": "rule", "ground_truth": {"target": ["Shakespeare"]}},
        "extra_info": {"index": 7, "question": "who wrote Hamlet?"},
    }
    (task,) = adapt_tasks([row], QA, env="search-qa", source="f")
    assert task == {"id": "nq-7", "question": "who wrote Hamlet?",
                    "answers": {"target": ["Shakespeare"]}, "row": row}  # fmt: skip


def test_native_rows_and_opted_out_envs_pass_unchanged() -> None:
    native = {"question": "q", "answers": ["a"], "prompt": "ignored"}
    plain = {"question": "q", "golden_answers": ["a"]}
    assert adapt_tasks([native, plain], QA, env="search-qa", source="f") == [native, plain]
    trl = {"prompt": "q", "answer": "a"}
    assert adapt_tasks([trl], None, env="swe-repair", source="f") == [trl]
    assert (layout(trl), layout(plain)) == ("trl", None)


def test_repeated_verl_indexes_fall_back_to_content_ids() -> None:
    rows = [{"prompt": "What?", "reward_model": {"ground_truth": n},
             "extra_info": {"index": 0}} for n in (1, 2)]  # fmt: skip
    tasks = adapt_tasks(rows, ("question", "answer"), env="arith", source="f")
    assert [t.get("id") for t in tasks] == [None, None]
    assert [t["answer"] for t in tasks] == ["1", "2"]
