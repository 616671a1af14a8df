"""A plain torch training loop fed by `libra serve-rollout`, group by group.

    libra serve-rollout examples/serve-rollout.toml          # terminal 1 (repo root)
    python examples/train_from_stream.py                     # terminal 2

Each step submits a batch (`--tasks` prompts x `--group-size` samples) and trains on
every GRPO group the moment its last sample finishes: group-normalised advantages, a
policy-gradient loss over the tokens the model generated (`loss_mask` 1), gradients
accumulated while the rest of the batch is still rolling out. After the batch it takes
one optimizer step, saves the weights and calls `POST /v1/weights`, so the next batch
samples from them (its records carry the new `policy_version`).

Nothing here is Libra's trainer: the same loop works with any torch / transformers / TRL
code. The default env `say-a` (examples/stream_env.py) rewards the share of the letter
"a" in the reply, which the tiny random default model can learn in a few steps.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from libra.client import Client, Group


def group_loss(
    model: torch.nn.Module, group: Group, temperature: float
) -> tuple[torch.Tensor, int]:
    """Sum over the group's model tokens of -advantage * log p(token); and the count."""
    rewards = torch.tensor([r.reward for r in group.records])
    if len(rewards) < 2 or rewards.std() == 0:
        return torch.zeros(()), 0  # no signal in this group
    adv = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
    loss, tokens = torch.zeros(()), 0
    for rec, a in zip(group.records, adv, strict=True):
        if rec.status not in ("ok", "truncated"):
            continue
        ids = torch.tensor(rec.prompt_token_ids + rec.response_token_ids)
        # Position t predicts token t + 1: the mask covers predictions of response tokens
        # the model generated (tool and template tokens have loss_mask 0).
        mask = torch.tensor([0] * (rec.prompt_tokens - 1) + rec.loss_mask, dtype=torch.float32)
        logits = model(ids[None]).logits[0, :-1] / temperature
        logp = torch.log_softmax(logits.float(), -1).gather(-1, ids[1:, None])[:, 0]
        loss = loss - a * (logp * mask).sum()
        tokens += int(mask.sum())
    return loss, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8700", help="the service")
    ap.add_argument("--model", help="model folder the engines serve (default: the tiny default)")
    ap.add_argument("--env", default="say-a")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--tasks", type=int, default=8, help="prompts per batch")
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens per reply")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--out", default="runs/stream-ckpt", help="where checkpoints go")
    args = ap.parse_args()

    if args.model is None:
        from libra.rollout.run import resolve_model

        args.model = str(resolve_model(None))
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    sampling = {"temperature": args.temperature, "max_tokens": args.max_tokens}

    with Client(args.url) as client:
        for step in range(args.steps):
            tasks = [{"id": f"s{step}-{i}", "question": f"Say something ({i})."}
                     for i in range(args.tasks)]  # fmt: skip
            batch = client.submit(args.env, tasks, group_size=args.group_size,
                                  sampling=sampling, step=step)  # fmt: skip
            rewards, tokens, trained, groups, versions = [], 0, 0, 0, set()
            opt.zero_grad()
            for group in client.groups(batch):  # one completed group at a time
                loss, n = group_loss(model, group, args.temperature)
                if n:
                    (loss / (args.tasks * args.group_size)).backward()
                    trained += 1
                groups += 1
                tokens += n
                rewards += [r.reward for r in group.records]
                versions |= {t.policy_version for r in group.records for t in r.turns}
            opt.step()
            ckpt = Path(args.out) / f"step-{step + 1}"
            model.save_pretrained(ckpt, safe_serialization=True)
            client.update_weights(step + 1, str(ckpt.resolve()))
            print(
                f"step {step}: mean reward {statistics.mean(rewards):.4f} over "
                f"{len(rewards)} samples from policy version(s) {sorted(versions)}; "
                f"trained on {trained}/{groups} groups ({tokens} tokens; a group whose "
                f"samples scored alike has no signal); loaded version {step + 1}",
                flush=True,
            )


if __name__ == "__main__":
    main()
