"""Training frameworks on fzero: Hugging Face `Trainer`, Accelerate and Lightning.

Each framework already drives DeepSpeed; these modules let it drive fzero through the same code path, holding
`fzero.deepspeed.alias.alias_deepspeed()` so that the framework's own `import deepspeed` finds fzero's shell:

- `fzero.integrations.accelerate.Accelerator`: an `accelerate.Accelerator` taking `fzero_config=`;
- `fzero.integrations.transformers.FzeroTrainer` and `FzeroTrainingArguments`: Hugging Face's `Trainer`;
- `fzero.integrations.lightning.FzeroStrategy`: `lightning.Trainer(strategy=FzeroStrategy(config=...))`.

The modules import their framework on import; this package imports none of them.

May import: every package (the frameworks sit on top, over the `fzero.deepspeed` shell they drive).
"""
