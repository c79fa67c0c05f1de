"""``env = "module:factory"`` targets for the loader tests (imported as ``_env_factories:<name>``)."""

from moe_rl.envs import AdditionTask, AdditionTaskConfig, EpisodeResult
from moe_rl.envs.protocol import Environment


class Const(Environment):
    def __init__(self, tok, value=1.0):
        self.tok = tok
        self.value = value

    def sample(self, rng, heldout=False):
        return 0

    async def episode(self, problem, ctx):
        return EpisodeResult(self.value, "answered")


def make_const(tok, value=1.0):
    return Const(tok, value)


def legacy_task(tok):
    return AdditionTask(AdditionTaskConfig(num_digits=1, max_new_tokens=3), tok)


class OldStyle:
    """The task interface without subclassing Environment."""

    def __init__(self, tok):
        self.tok = tok
        self.cfg = AdditionTaskConfig(num_digits=1, max_new_tokens=3)
        self.inner = AdditionTask(self.cfg, tok)

    def sample(self, rng):
        return self.inner.sample(rng)

    def prompt_ids(self, p):
        return self.inner.prompt_ids(p)

    def reward(self, p, ids):
        return self.inner.reward(p, ids)


def old_style(tok):
    return OldStyle(tok)


def not_an_env(tok):
    return object()


def raises(tok):
    raise RuntimeError("factory refuses")


NOT_CALLABLE = 3
