"""The SFT warm-up on an environment with demonstrations: batches are the demonstrations with the loss on the
model's turns, and the evaluation plays greedy episodes with the real tool (stop token included)."""

import random

import torch

from moe_rl.envs import CharTokenizer
from moe_rl.envs.calculator import make_env
from moe_rl.runtime.trainer.sft import _sft_batch, evaluate_episodes

TOK = CharTokenizer()


class OracleModel(torch.nn.Module):
    """``[B, T]`` ids -> ``[B, T, V]`` logits whose last position picks the expert's next token (the tool call on the
    current value and step, or the answer and EOS); ``wrong`` adds 1 to every answer."""

    def __init__(self, wrong=False):
        super().__init__()
        self.wrong = wrong

    def forward(self, ids):
        out = torch.zeros(ids.shape[0], ids.shape[1], TOK.vocab_size)
        for b, row in enumerate(ids.tolist()):
            text = TOK.decode(row, stop_at_eos=False)
            seg = text[text.rfind("=") + 1:]
            value, step = seg.split("|", 1)
            done_step = step.split(";")[0] if ";" in step else step
            if done_step.startswith("."):
                ans = str(int(value) + (1 if self.wrong else 0))
                written = done_step[1:]
                nxt = TOK.encode(ans[len(written)], bos=False)[0] if len(written) < len(ans) else TOK.eos_id
            else:
                call = f"[{value}{done_step}]"
                written = step[len(done_step) + 1:]
                nxt = TOK.encode(call[len(written)], bos=False)[0]
            out[b, -1, nxt] = 1.0
        return out


def test_sft_batch_is_the_demonstrations_with_the_model_turns_on_the_loss():
    env = make_env(TOK)
    ids, mask = _sft_batch(env, random.Random(0), 6)
    rng = random.Random(0)
    demos = []
    while len(demos) < 6:  # the same draws: problems without a demonstration are skipped
        d = env.demonstration(env.sample(rng))
        if d is not None:
            demos.append(d)
    for row, d in enumerate(demos):
        n = len(d.token_ids)
        assert ids[row, :n].tolist() == list(d.token_ids) and bool((ids[row, n:] == TOK.pad_id).all())
        assert mask[row, : n - 1].tolist() == list(d.loss_mask[1:]) and not bool(mask[row, n - 1:].any())


def test_greedy_episodes_with_the_tool_score_the_policy():
    env = make_env(TOK, max_ops=3)
    problems = env.heldout_set(6, seed=3)
    assert evaluate_episodes(OracleModel(), env, problems) == {"pass_rate": 1.0, "reward_mean": 1.0}
    wrong = evaluate_episodes(OracleModel(wrong=True), env, problems)
    assert wrong["pass_rate"] == 0.0 and 0.0 <= wrong["reward_mean"] < 1.0
