"""Loading a checkpoint: tied embeddings stay tied (and unpacked when the runner packs the
untied head), and building the model imports nothing heavy
(an engine core, each tensor-parallel worker and each restart pays for whatever loading imports)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mmserve.models.loader import load_model
from mmserve.models.parallel import pack_linears
from helpers.tiny_models import make_checkpoint, make_qwen_checkpoint, make_tied_copy

SRC = str(Path(__file__).resolve().parents[2] / "src")


@pytest.mark.parametrize("keep_head", [False, True], ids=["head-dropped", "head-stored"])
def test_a_tied_checkpoints_head_is_its_embedding_table(tmp_path, keep_head):
    path = make_tied_copy(make_qwen_checkpoint(tmp_path), tmp_path / "tied", keep_head)
    model = load_model(path)
    embed = model.model.language_model.embed_tokens.weight
    assert model.lm_head.weight is embed  # one parameter: loading the table loads the head
    stored = load_file(str(Path(path) / "model.safetensors"))["model.language_model.embed_tokens.weight"]
    assert torch.equal(embed, stored)
    hidden = torch.randn(2, embed.shape[1])
    assert torch.equal(model.compute_logits(hidden), hidden @ stored.T)


def test_an_untied_checkpoint_keeps_its_own_head(tmp_path):
    path = make_qwen_checkpoint(tmp_path)
    model = load_model(path)
    stored = load_file(str(Path(path) / "model.safetensors"))
    assert model.lm_head.weight is not model.model.language_model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, stored["lm_head.weight"])


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch")
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_the_runners_packing_takes_an_untied_head_and_leaves_a_tied_one(tmp_path, tied):
    """`pack_linears` (the runner's on a float32 CPU model) packs an untied LM head for oneDNN as
    it packs the decoder's dense layers; a tied head is the embedding table, whose rows the
    embedding reads, and stays as it is."""
    path = make_qwen_checkpoint(tmp_path)
    if tied:
        path = make_tied_copy(path, tmp_path / "tied")
    model = load_model(path)
    head = model.lm_head.weight.detach().clone()
    hidden = torch.randn(3, head.shape[1])
    before = model.compute_logits(hidden)

    pack_linears(model)

    embed = model.model.language_model.embed_tokens.weight
    assert model.lm_head.weight.is_mkldnn != tied and (model.lm_head.weight is embed) == tied
    assert not embed.is_mkldnn
    torch.testing.assert_close(model.compute_logits(hidden), before, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(model.compute_logits(hidden), hidden @ head.T, atol=1e-5, rtol=1e-5)


def test_loading_imports_neither_dynamo_nor_sympy(tmp_path):
    """Both come with torch but cost ~2.3 s to import; building on the meta device and giving the
    parameters memory used to import them (`nn.Embedding`'s init and `Module.to_empty`)."""
    paths = [make_checkpoint(tmp_path), make_qwen_checkpoint(tmp_path)]
    code = ("import sys\nfrom mmserve.models.loader import load_model\n"
            f"for path in {paths!r}:\n    load_model(path)\n"
            "print(sorted(m for m in ('torch._dynamo', 'sympy', 'transformers') if m in sys.modules))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": SRC, "PATH": "/usr/bin:/bin"})
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"
