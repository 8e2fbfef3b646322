"""The torch.distributed.backends entry point (torch 2.15 and later): registers "dtrain" on first use."""


def register():
    import dtrain  # noqa: F401  (importing registers it)
