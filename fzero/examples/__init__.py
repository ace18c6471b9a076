"""Small, real workloads for fzero: a GPT-style model on a bundled corpus, and the main training job."""
