"""One online RL update on fixed rollouts, on as many processes as launched it (used by test_distributed_rl.py).

    python tests/distributed_rl_update.py OUT                                       # one process
    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/distributed_rl_update.py OUT

For each case the real code runs: ``build_run`` (Accelerator, DDP, optimizers, reference, critic), ``to_batch``
(this rank's share of 8 fixed samples: 4 prompts x 2, of different lengths, one truncated and left out of the loss,
one with tool tokens), ``score_batch`` (reference / old log-probs, values, the estimator) and ``update_models``
(critic and actor, ppo_epochs optimizer steps). Rank 0 writes the updated trainable parameters and every rank's
metrics to OUT/<case>.pt.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

CASES = {
    # group advantages, token-mean, KL loss against a frozen reference, entropy bonus, 2 updates (old log-probs)
    "grpo_token_mean": {
        "adv_estimator": "grpo",
        "loss_agg": "token-mean",
        "kl_loss_coef": 0.1,
        "entropy_coef": 0.01,
        "ppo_epochs": 2,
    },
    # whitening over the whole batch, a per-sequence mean
    "rpp_seq_mean": {"adv_estimator": "reinforce_plus_plus", "loss_agg": "seq-mean-token-mean", "ppo_epochs": 2},
    # a critic (values, GAE, batch whitening), the adaptive in-reward KL, a constant-length sum
    "gae_seq_sum_norm": {
        "adv_estimator": "gae",
        "loss_agg": "seq-mean-token-sum-norm",
        "kl_in_reward_coef": 0.05,
        "kl_controller": "adaptive",
        "kl_target": 0.1,
        "kl_horizon": 100,
        "ppo_epochs": 2,
    },
}
# the same with packed micro-batches (``rollout.packing: on``): each rank packs its own rows into padding-free rows
CASES["gae_seq_sum_norm_packed"] = {**CASES["gae_seq_sum_norm"], "rollout": {"packing": "on"}}
# a token budget per micro-batch (``rollout.micro_batch_tokens``, 5..17 tokens a sample): the ranks cut their shares
# into different numbers of micro-batches, and DDP still synchronises once per mini-batch
CASES["grpo_token_budget_packed"] = {**CASES["grpo_token_mean"], "rollout": {"packing": "on", "micro_batch_tokens": 12}}
# no KL or entropy term, three of the four groups with one reward each: their rows run forward only
# (``algorithm.skip_zero_advantage_backward``); one rank holds two such groups, so all its rows have zero advantage and
# it still runs one (zero) backward for DDP's reduction
CASES["grpo_zero_advantage_packed"] = {
    "adv_estimator": "grpo",
    "loss_agg": "token-mean",
    "ppo_epochs": 2,
    "scores": [1.0, 0.0, 0.5, 0.5, 0.3, 0.3, 0.2, 0.2],
    "rollout": {"packing": "on", "micro_batch_tokens": 12},
}
MAX_LEN = 12


SCORES = [1.0, 0.0, 0.5, 0.5, 1.0, -1.0, 0.2, 0.9]


def samples(scores: list[float] = SCORES) -> list:
    """8 scored samples in 4 groups of 2 (by default one group with equal scores), as the gathered sample list of a
    step."""
    from rlfactory.engine.online.phases import Rollout
    from rlfactory.rollout.base import Completion

    gen = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(3, 1000, (n,), generator=gen).tolist()
    lengths = [(5, 4), (5, MAX_LEN), (2, 3), (2, 7), (9, 1), (9, 5), (3, 6), (3, 2)]
    out = []
    for i, ((n_prompt, n_response), score) in enumerate(zip(lengths, scores, strict=True)):
        prompt = ids(n_prompt) if i % 2 == 0 else out[-1].prompt_ids  # a group shares its prompt
        tokens = ids(n_response)
        reason = "length" if n_response == MAX_LEN else "stop"
        mask = [1, 1, 0, 0, 1, 1, 1] if n_response == 7 else None  # two tool tokens: not the policy's
        out.append(Rollout({}, prompt, Completion(tokens, reason, mask=mask), "", i // 2, score, {}))
    return out


def record_gradients(accelerator, updater, part: str, grads: dict) -> None:
    """Keep the gradient of each of ``updater``'s optimizer steps (after DDP's sync and clipping) as
    ``grads["<part>.<step>.<name>"]``."""
    step = updater.optimizer.step
    count = [0]

    def recording(*args, **kwargs):
        model = accelerator.unwrap_model(updater.model)
        for name, param in model.named_parameters():
            if param.grad is not None:
                grads[f"{part}.{count[0]}.{name}"] = param.grad.clone()
        count[0] += 1
        return step(*args, **kwargs)

    updater.optimizer.step = recording


def trainable(run) -> dict[str, torch.Tensor]:
    """A copy of the trained parameters of the run's policy (and critic)."""
    models = {"policy": run.actor.model} | ({"critic": run.critic.model} if run.critic is not None else {})
    return {
        f"{part}.{key}": value.detach().clone()
        for part, model in models.items()
        for key, value in run.accelerator.unwrap_model(model).named_parameters()
        if value.requires_grad
    }


def run_case(name: str, algorithm: dict, out: Path) -> None:
    from rlfactory.config.schema import RunConfig
    from rlfactory.engine.online.loop import build_run
    from rlfactory.engine.online.phases import score_batch, to_batch, update_models
    from rlfactory.model.loader import load_model, load_tokenizer
    from rlfactory.model.value_head import load_value_model

    algorithm = dict(algorithm)
    scores = algorithm.pop("scores", SCORES)
    # padded unless the case packs (auto would pack transformers' own models)
    rollout = {"prompts_per_step": 4, "num_samples": 2, "max_response_len": MAX_LEN, "mask_truncated": True}
    rollout["packing"] = "off"
    rollout.update(algorithm.pop("rollout", {}))
    raw = {
        "stage": "grpo",
        "output_dir": str(out / name),
        "seed": 7,
        "model": {"name_or_path": str(ROOT / "data" / "models" / "tiny-arith"), "finetuning": "full"},
        "data": {"dataset": "arith_prompts"},
        "rollout": rollout,
        "reward": {"functions": {"answer_match": 1.0}},
        "algorithm": algorithm,
        # no clipping: the recorded gradients are the raw ones (clipping would hide a wrong scale, as AdamW does)
        "train": {
            "max_steps": 1,
            "per_device_batch_size": 3,
            "learning_rate": 1e-3,
            "mixed_precision": "no",
            "max_grad_norm": None,
        },
        "logging": {"progress_bar": False},
    }
    if algorithm["adv_estimator"] == "gae":
        raw["critic"] = {"learning_rate": 1e-3}
    cfg = RunConfig.model_validate(raw)
    tokenizer = load_tokenizer(cfg.model)
    policy = load_model(cfg.model, cfg.lora, cfg.freeze)
    critic = load_value_model(cfg) if cfg.critic is not None else None
    run = build_run(cfg, policy, tokenizer, [], [], critic)
    before = trainable(run)
    grads: dict[str, torch.Tensor] = {}
    for part, updater in (("policy", run.actor), ("critic", run.critic)):
        if updater is not None:
            record_gradients(run.accelerator, updater, part, grads)
    batch = to_batch(run, samples(scores))
    metrics, advantages = score_batch(run, batch)
    update_metrics, _ = update_models(run, batch, 0)
    metrics.update(update_metrics)
    metrics["kl_coef_after"] = run.kl_ctrl.value
    metrics["rows"] = float(len(batch))
    metrics["packed"] = float(bool(run.actor.packing) and (run.critic is None or bool(run.critic.packing)))
    every = run.ranks.gather_objects([metrics])
    if run.accelerator.is_main_process:
        after = trainable(run)
        updates = {key: after[key] - before[key] for key in after}
        result = {"params": after, "updates": updates, "grads": grads, "metrics": every, "advantages": advantages}
        torch.save(result, out / f"{name}.pt")
    run.accelerator.wait_for_everyone()


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for name, algorithm in CASES.items():
        run_case(name, algorithm, out)
    if torch.distributed.is_initialized():  # as the CLI ends a launched run (launch.close_process_group)
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
