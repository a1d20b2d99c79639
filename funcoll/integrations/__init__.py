"""funcoll inside other frameworks: each submodule imports its framework only when it is imported.

* :mod:`funcoll.integrations.torchtitan`: ``funcoll.moe`` as a torchtitan token dispatcher.
"""
