"""TRL's GRPOTrainer trained on `libra serve-rollout`'s episodes.

    libra serve-rollout examples/serve-rollout.toml          # terminal 1 (repo root)
    python examples/trl_grpo.py                              # terminal 2

TRL owns the training (its `GRPOTrainer`: group advantages, clipped loss, optimizer);
Libra owns the rollouts: `LibraRollout` is the trainer's `rollout_func`. Each step TRL
hands it the batch's prompts; the service runs the episodes on its engines and streams
the records back; TRL trains on the model's tokens only (`env_mask` is 0 on tool and
template tokens) with the env's reward (`libra_reward`). After each optimizer step
`rollout.publisher()` sends the new weights from memory to the service's engines, so the
next step samples from them.

The dataset is in TRL's layout (`prompt` messages + `answer`): the service maps it onto the
env's fields. The default env `say-a` (examples/stream_env.py) rewards the share of the
letter "a" in the reply, which gives the tiny random default model a signal; `--env arith`
runs the multi-turn calculator episodes (the tiny model will not learn arithmetic).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def trl_rows(n: int) -> list[dict[str, Any]]:
    """The first `n` arith tasks as a TRL dataset would hold them."""
    lines = (HERE.parent / "envs" / "data" / "arith.jsonl").read_text().splitlines()[:n]
    tasks = [json.loads(line) for line in lines]
    return [{"prompt": [{"role": "user", "content": t["question"]}], "answer": t["answer"]}
            for t in tasks]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8700", help="the service")
    ap.add_argument("--model", help="model folder the engines serve (default: the tiny default)")
    ap.add_argument("--env", default="say-a")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=4, help="prompts per step")
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48, help="tokens per model turn")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--out", default="runs/trl-grpo", help="TRL's output folder")
    args = ap.parse_args()

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from libra.integrations.trl import LibraRollout, libra_reward

    if args.model is None:
        from libra.rollout.run import resolve_model

        args.model = str(resolve_model(None))
    dataset = Dataset.from_list(trl_rows(args.prompts * args.steps))
    rollout = LibraRollout(args.url, env=args.env, dataset=dataset)

    class Report(TrainerCallback):  # type: ignore[misc]
        """One line per step: TRL's logged reward and what Libra served it from."""

        def on_log(self, a: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
            if not logs or "reward" not in logs:
                return
            recs = rollout.records
            versions = sorted({t.policy_version for r in recs for t in r.turns})
            tool = sum(r.loss_mask.count(0) for r in recs)
            rewards = [r.reward for r in recs if r.status in ("ok", "truncated")]
            print(
                f"step {state.global_step}: reward {logs['reward']:.4f} "
                f"(libra_reward mean {statistics.mean(rewards) if rewards else float('nan'):.4f}"
                f" over {len(rewards)}/{len(recs)} episodes, {tool} tool/template tokens "
                f"masked) from policy version(s) {versions}; published version "
                f"{rollout.published}",
                flush=True,
            )

    config = GRPOConfig(
        output_dir=args.out,
        max_steps=args.steps,
        per_device_train_batch_size=args.prompts * args.group_size,
        num_generations=args.group_size,
        max_completion_length=args.max_tokens,
        learning_rate=args.lr,
        beta=0.0,
        temperature=1.0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        bf16=False,
        seed=0,
    )
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    trainer = GRPOTrainer(
        model=model,
        args=config,
        processing_class=AutoTokenizer.from_pretrained(args.model),
        train_dataset=dataset,
        reward_funcs=[libra_reward],
        rollout_func=rollout,
        callbacks=[rollout.publisher(), Report()],
    )
    try:
        trainer.train()
    finally:
        rollout.close()


if __name__ == "__main__":
    main()
