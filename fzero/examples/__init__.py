"""Small, real workloads for fzero: a GPT-style model on a bundled corpus, and the main training job.

May import: `fzero` itself (the public API, as a user's script does) and `fzero.sharding` (`fzero.call`).
"""
