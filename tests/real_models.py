"""Third-party models built from configs (no downloads) and the plain-PyTorch reference they are checked against.

Tiny Hugging Face `transformers` models (GPT-2, Llama, BERT, Mixtral), a peft LoRA adapter, and a torchvision-style
ResNet (BatchNorm, in-place ReLU, no `nn.ModuleList`), with the loss, batches and reference run the tests share.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

import fzero
from tests.support import differing

warnings.filterwarnings("ignore", message=".*loss_type=None.*")

V, T = 64, 8  # vocabulary, sequence length


def _quiet() -> None:
    import transformers

    transformers.logging.set_verbosity_error()


def gpt2(seed: int = 0, dropout: float = 0.0, layers: int = 2, width: int = 32) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    _quiet()
    torch.manual_seed(seed)
    # attention dropout stays 0: torch's attention draws its dropout differently when a checkpoint recomputes it,
    # in plain PyTorch too, so runs with and without checkpointing could not be compared bitwise
    cfg = GPT2Config(vocab_size=V, n_positions=16, n_embd=width, n_layer=layers, n_head=2, resid_pdrop=dropout,
                     embd_pdrop=dropout, attn_pdrop=0.0)  # fmt: skip
    return GPT2LMHeadModel(cfg).train()


def llama(seed: int = 0, dropout: float = 0.0) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    _quiet()
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=16, attention_dropout=dropout)  # fmt: skip
    return LlamaForCausalLM(cfg).train()


def bert(seed: int = 0, dropout: float = 0.0) -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    _quiet()
    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                     max_position_embeddings=16, hidden_dropout_prob=dropout,
                     attention_probs_dropout_prob=0.0)  # fmt: skip
    return BertForMaskedLM(cfg).train()


def mixtral(seed: int = 0, dropout: float = 0.0) -> nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    _quiet()
    torch.manual_seed(seed)
    cfg = MixtralConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                        num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2,
                        max_position_embeddings=16)  # fmt: skip
    return MixtralForCausalLM(cfg).train()


MODELS = {"gpt2": gpt2, "llama": llama, "bert": bert, "mixtral": mixtral}


def frozen_embeddings(seed: int = 0) -> nn.Module:
    """GPT-2 with its token embedding frozen: `lm_head.weight` is the same (frozen) tensor."""
    model = gpt2(seed)
    model.transformer.wte.weight.requires_grad_(False)
    assert model.lm_head.weight is model.transformer.wte.weight
    return model


def lora(seed: int = 0, base: str = "gpt2", dropout: float = 0.0) -> nn.Module:
    """A peft LoRA adapter (rank 4) on a tiny GPT-2 or Llama: the base model frozen, the adapters trained."""
    from peft import LoraConfig, get_peft_model

    model = MODELS[base](seed)
    targets = ["c_attn", "c_proj"] if base == "gpt2" else ["q_proj", "v_proj"]
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=dropout, fan_in_fan_out=base == "gpt2")
    torch.manual_seed(seed + 1)
    return get_peft_model(model, cfg).train()


class Block(nn.Module):
    """torchvision's BasicBlock: conv-BN-ReLU(inplace)-conv-BN, `out += identity`, ReLU(inplace)."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


class ResNet(nn.Module):
    """A small torchvision-style ResNet (stages of `nn.Sequential` blocks: no `nn.ModuleList`)."""

    def __init__(self, width: int = 8, classes: int = 10) -> None:
        super().__init__()
        w = width
        self.conv1 = nn.Conv2d(3, w, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(w)
        self.relu = nn.ReLU(inplace=True)
        self.layer1 = nn.Sequential(Block(w, w, 1), Block(w, w, 1))
        self.layer2 = nn.Sequential(Block(w, 2 * w, 2), Block(2 * w, 2 * w, 1))
        self.layer3 = nn.Sequential(Block(2 * w, 4 * w, 2), Block(4 * w, 4 * w, 1))
        self.fc = nn.Linear(4 * w, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer3(self.layer2(self.layer1(x)))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def resnet(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return ResNet()


# ------------------------------------------------------------------------------------------------ losses and data
def lm_loss(model: nn.Module):
    """The model's own loss (`labels=` the inputs; causal models shift them, BERT predicts every token)."""

    def loss_fn(params, batch):
        return torch.func.functional_call(model, params, (batch["x"],), {"labels": batch["x"]}).loss

    return loss_fn


def image_loss(model: nn.Module):
    def loss_fn(params, batch):
        return F.cross_entropy(torch.func.functional_call(model, params, (batch["x"],)), batch["y"])

    return loss_fn


def token_batches(world: int, steps: int, per_rank: int = 2, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{"x": torch.randint(0, V, (world, per_rank, T), generator=g)} for _ in range(steps)]


def image_batches(world: int, steps: int, per_rank: int = 4, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        x = torch.randn(world, per_rank, 3, 16, 16, generator=g)
        out.append({"x": x, "y": torch.randint(0, 10, (world, per_rank), generator=g)})
    return out


def train(model, batches, preset="zero2", *, world=2, lr=1e-2, precision=None, loss=lm_loss, units=None, **kw):
    """fzero's functional core on a SimMesh: the final state and the last step's metrics."""
    mesh = fzero.SimMesh(world)
    tx = getattr(fzero, preset)(fzero.adamw(lr), precision=precision)
    state = fzero.init(model, tx, mesh, units=units)
    step = fzero.train_step(model, loss(model), tx, mesh, **kw)
    metrics = {}
    for batch in batches:
        if precision is not None:
            batch = fzero.get_policy(precision).cast_to_compute(batch)
        state, metrics = step(state, batch)
    return state, metrics


def reference(model: nn.Module, batches, lr: float = 1e-2) -> dict[str, torch.Tensor]:
    """Plain single-process `torch.optim.AdamW` on the full batch (every rank's examples at once), over the
    trainable parameters; the model's `state_dict()` at the end."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, foreach=False)
    for batch in batches:
        opt.zero_grad()
        full = {k: v.flatten(0, 1) for k, v in batch.items()}
        out = model(full["x"], labels=full["x"]) if "y" not in full else None
        loss = out.loss if out is not None else F.cross_entropy(model(full["x"]), full["y"])
        loss.backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b), sorted(set(a) ^ set(b))
    differ = differing(a, b)
    assert not differ, f"{len(differ)} tensors differ, e.g. {differ[:3]}"
