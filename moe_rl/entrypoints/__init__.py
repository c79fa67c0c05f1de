"""Process entry points (``moe-rl rl``). Import the submodule you need; nothing is imported here."""
