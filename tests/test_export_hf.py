"""`fzero.interop.export_hf` / `fzero export-hf`: an fzero checkpoint as the folder `save_pretrained` writes.

Tiny GPT-2 (tied embeddings), Llama (untied, and tied), and GPT-2 with a frozen tied embedding trained through the
DeepSpeed-style engine, each trained 2 steps and saved. Every comparison is bitwise (the export copies the
checkpoint's bits, or rounds them to bf16 exactly as `Tensor.to` does): `from_pretrained(OUT)` loads with no
missing, unexpected or mismatched key and holds `fzero.consolidate`'s tensors; and the folder is byte for byte the
one the model's own `save_pretrained` writes (same files, same index, same config.json) after loading those tensors.
"""

from __future__ import annotations

import inspect
import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch

import fzero
from fzero.checkpoint import IncompatibleCheckpointError
from fzero.checkpoint.consolidate import Consolidated, iter_consolidated
from fzero.interop.hf import DEFAULT_MAX_SHARD_SIZE, TOKENIZER_FILES, export_hf
from tests.real_models import frozen_embeddings, gpt2, llama, token_batches, train

pytest.importorskip("transformers")

SMALL = "20KB"  # below every tiny model's size: 3 to 7 files


def llama_tied(seed: int = 0):
    from transformers import LlamaForCausalLM

    model = llama(seed)
    model.config.tie_word_embeddings = True
    torch.manual_seed(seed)
    return LlamaForCausalLM(model.config).train()


def _engine_gpt2(root: Path) -> Path:
    """GPT-2 with a frozen tied embedding through `fzero.initialize` (stage 3, bf16 compute, one process),
    `engine.save_checkpoint`: the engine's checkpoint, its frozen buffer and the alias of a frozen parameter."""
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0, "zero_optimization": {"stage": 3},
              "bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}  # fmt: skip
    model = frozen_embeddings()
    engine, *_ = fzero.initialize(model=model, model_parameters=model.parameters(), config=config,
                                  printer=lambda line: None)  # fmt: skip
    for batch in token_batches(world=1, steps=2, per_rank=4):
        engine.backward(engine(batch["x"][0], labels=batch["x"][0]).loss)
        engine.step()
    engine.save_checkpoint(str(root))
    return root


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """{name: (make, checkpoint root, config directory)}: each model trained 2 steps at stage 3 on SimMesh(2)."""
    base = tmp_path_factory.mktemp("export_hf")
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, make in {"gpt2": gpt2, "llama": llama, "llama_tied": llama_tied}.items():
            state, _ = train(make(), token_batches(world=2, steps=2), "zero3")
            fzero.save(state, base / name)
            out[name] = (make, base / name)
        out["gpt2_engine"] = (frozen_embeddings, _engine_gpt2(base / "gpt2_engine"))
    for name, (make, root) in list(out.items()):
        config = base / f"{name}-config"
        make().config.save_pretrained(config)
        out[name] = (make, root, config)
    # beside GPT-2's config: a generation config of its own and a tokenizer file, carried into the export
    (out["gpt2"][2] / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 0.7}))
    (out["gpt2"][2] / "tokenizer_config.json").write_text('{"model_max_length": 16}\n')
    return out


def _reference(make, config: Path, tensors: dict[str, torch.Tensor], out: Path, dtype, size: str) -> None:
    """What the model's own save_pretrained writes once `tensors` are loaded (strictly) into it."""
    from transformers import GenerationConfig

    model = make()
    model.load_state_dict(tensors, strict=True)
    if (config / "generation_config.json").is_file():  # as from_pretrained(config dir) would have set it
        model.generation_config = GenerationConfig.from_pretrained(config)
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(out, max_shard_size=size)


@pytest.mark.parametrize(
    "name, dtype, size",
    [("gpt2", None, SMALL), ("gpt2", torch.bfloat16, DEFAULT_MAX_SHARD_SIZE), ("llama", None, SMALL),
     ("llama", torch.bfloat16, DEFAULT_MAX_SHARD_SIZE), ("llama_tied", torch.bfloat16, SMALL),
     ("gpt2_engine", None, SMALL)],
)  # fmt: skip
def test_from_pretrained_holds_the_consolidated_tensors(trained, tmp_path, name, dtype, size):
    """Strict `from_pretrained`, every tensor bitwise `consolidate`'s (rounded to bf16 for --dtype bf16, and the
    model is then bf16), and the folder byte for byte `save_pretrained`'s: files, shard split, index, config."""
    from transformers import AutoModelForCausalLM

    make, root, config = trained[name]
    out = export_hf(root, tmp_path / "hf", config=config, dtype=dtype, max_shard_size=size)
    consolidated = fzero.consolidate(root)
    loaded, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}, info
    assert type(loaded) is type(make())
    assert loaded.dtype == (dtype or torch.float32)
    state = loaded.state_dict()
    assert set(state) == set(consolidated)
    for key, want in consolidated.items():
        want = want.to(dtype) if dtype is not None and want.is_floating_point() else want
        assert state[key].dtype == want.dtype and torch.equal(state[key], want), key

    files = sorted(p.name for p in out.iterdir())
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(shards) >= 2 if size == SMALL else shards == ["model.safetensors"], files
    _reference(make, config, consolidated, tmp_path / "ref", dtype, size)
    expected = sorted(p.name for p in (tmp_path / "ref").iterdir())
    copied = [f for f in TOKENIZER_FILES if (config / f).is_file()]
    assert files == sorted(expected + copied)
    for f in expected:
        assert (out / f).read_bytes() == (tmp_path / "ref" / f).read_bytes(), f
    for f in copied:
        assert (out / f).read_bytes() == (config / f).read_bytes(), f
    if len(shards) > 1:  # the index's keys: the model's state_dict without what save_pretrained drops
        weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
        dropped = {"gpt2": {"lm_head.weight"}, "llama_tied": {"lm_head.weight"}, "llama": set()}
        assert set(weight_map) == set(consolidated) - dropped.get(name, {"lm_head.weight"})
    if name == "gpt2":  # the generation config beside config.json is the one carried
        assert loaded.generation_config.temperature == 0.7
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporaries left


def test_command_line(trained, tmp_path, capsys):
    """`fzero export-hf` on a checkpoint root (its `latest`, or --tag), and its error on an existing folder."""
    from fzero import cli

    _, root, config = trained["llama"]
    tag = (root / "latest").read_text().strip()
    argv = ["export-hf", str(root), str(tmp_path / "hf"), "--config", str(config), "--tag", tag, "--dtype", "bf16",
            "--max-shard-size", SMALL]  # fmt: skip

    def main(argv: list[str]) -> int:
        if "export-hf" in cli.COMMANDS:
            return cli.main(argv)
        import argparse

        from fzero.commands import export_hf as command

        parser = argparse.ArgumentParser(prog="fzero export-hf")
        command.add_arguments(parser)
        return command.run(parser.parse_args(argv[1:]))

    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert str(tmp_path / "hf") in printed and "safetensors file(s)" in printed
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    consolidated = fzero.consolidate(root, dtype=torch.bfloat16)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in consolidated.items())

    capsys.readouterr()  # from_pretrained's progress bar
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("fzero export-hf: error: ") and "exists and is not empty" in err
    assert main([*argv, "--overwrite", "--dtype", "fp32"]) == 0
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "hf").dtype == torch.float32


def _nothing_written(tmp_path: Path) -> bool:
    return not any(tmp_path.iterdir())


def test_a_checkpoint_that_does_not_fit_the_config_is_refused(trained, tmp_path):
    """Another model's config, other shapes, weights the config ties but the checkpoint trained apart, another
    model class: each an error naming the keys (or the class), and nothing written."""
    from transformers import GPT2Config, LlamaConfig

    _, gpt2_root, gpt2_config = trained["gpt2"]
    _, llama_root, llama_config = trained["llama"]
    out = tmp_path / "hf"
    with pytest.raises(IncompatibleCheckpointError, match=r"GPT2LMHeadModel has no place for: model\.embed_tokens"):
        export_hf(llama_root, out, config=gpt2_config)
    wider = GPT2Config.from_pretrained(gpt2_config)
    wider.vocab_size = 65
    with pytest.raises(IncompatibleCheckpointError, match=r"transformer\.wte\.weight \(checkpoint \[64, 32\], "
                                                          r"GPT2LMHeadModel \[65, 32\]\)"):  # fmt: skip
        export_hf(gpt2_root, out, config=wider)
    tied = LlamaConfig.from_pretrained(llama_config)
    tied.tie_word_embeddings = True
    with pytest.raises(IncompatibleCheckpointError, match=r"ties 'lm_head\.weight' to 'model\.embed_tokens\.weight'"):
        export_hf(llama_root, out, config=tied)
    with pytest.raises(ValueError, match="GPT2LMHeadModel takes a GPT2Config, the config is a LlamaConfig"):
        export_hf(llama_root, out, config=llama_config, model_class="GPT2LMHeadModel")
    with pytest.raises(ValueError, match="no config.json"):
        export_hf(llama_root, out, config=tmp_path)
    with pytest.raises(ValueError, match="max_shard_size '20XB'"):
        export_hf(llama_root, out, config=llama_config, max_shard_size="20XB")
    assert _nothing_written(tmp_path)


def test_an_existing_folder(trained, tmp_path):
    """An empty folder is filled; a non-empty one (or a file) is an error unless overwrite=True, which replaces it
    whole; a folder holding the checkpoint is never replaced."""
    _, root, config = trained["llama"]
    out = tmp_path / "hf"
    out.mkdir()
    export_hf(root, out, config=config)
    with pytest.raises(FileExistsError, match="exists and is not empty; pass overwrite=True"):
        export_hf(root, out, config=config, dtype=torch.bfloat16)
    (out / "stale.txt").write_text("from before")
    export_hf(root, out, config=config, overwrite=True, max_shard_size=SMALL)
    assert not (out / "stale.txt").exists() and (out / "model.safetensors.index.json").is_file()
    (tmp_path / "file").write_text("")
    with pytest.raises(FileExistsError, match="not a directory"):
        export_hf(root, tmp_path / "file", config=config, overwrite=True)
    shutil.copytree(root, tmp_path / "ckpt")
    with pytest.raises(ValueError, match="which the export reads"):
        export_hf(tmp_path / "ckpt", tmp_path / "ckpt", config=config, overwrite=True)
    assert fzero.consolidate(tmp_path / "ckpt").keys() == fzero.consolidate(root).keys()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "file", "hf"]  # no temporaries left


def test_weight_conversions_are_refused_or_written_as_held(tmp_path):
    """Mixtral's save_pretrained writes its fused experts back one tensor per expert: refused, naming the tensors;
    with original_format=False written as the model holds them, which from_pretrained reads strictly."""
    from transformers import AutoModelForCausalLM

    from tests.real_models import mixtral

    model = mixtral()
    fzero.save(fzero.init(model, fzero.zero0(fzero.adamw(1e-2)), fzero.SimMesh(1)), tmp_path / "ckpt")
    model.config.save_pretrained(tmp_path / "config")
    with pytest.raises(ValueError, match=r"converts weights .*experts\.down_proj"):
        export_hf(tmp_path / "ckpt", tmp_path / "hf", config=tmp_path / "config")
    assert not (tmp_path / "hf").exists()
    out = export_hf(tmp_path / "ckpt", tmp_path / "hf", config=tmp_path / "config", original_format=False)
    loaded, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}, info
    want = fzero.consolidate(tmp_path / "ckpt")
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in want.items())


def test_streaming_readers_agree_with_consolidate(trained):
    """`iter_consolidated` (in order) and `Consolidated` (any order: here backwards, re-reading units) give
    `consolidate`'s tensors bitwise, for parameters, aliases and frozen parameters."""
    from fzero.checkpoint import Checkpoint

    for name in ("gpt2", "gpt2_engine"):
        root = trained[name][1]
        want = fzero.consolidate(root)
        got = dict(iter_consolidated(root, dtype=None))
        assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)
        with Checkpoint(root) as ckpt:
            reader = Consolidated(ckpt, torch.bfloat16)
            for spec in reversed(reader.specs):
                t = reader.tensor(spec.name, copy=False)
                assert t.dtype == spec.dtype and torch.equal(t, want[spec.name].to(torch.bfloat16)), spec.name
            with pytest.raises(KeyError, match="no tensor 'nope'"):
                reader.tensor("nope")


def test_the_default_shard_size_is_save_pretrained_s():
    from transformers import PreTrainedModel

    default = inspect.signature(PreTrainedModel.save_pretrained).parameters["max_shard_size"].default
    assert default == DEFAULT_MAX_SHARD_SIZE
